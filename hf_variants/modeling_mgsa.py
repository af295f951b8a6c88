"""MG-SA: Multi-Granularity Self-Attention (Hao, Wang, Shi, Zhang, Tu, EMNLP 2019) on the hf_variants backbone.

What the paper adds to the Transformer, and nothing else (`docs/variants-spec.md` §3):

- `MgsaSelfAttention` replaces the self-attention of the encoder layers in `config.mgsa_layers`. Its first
  `word_heads` heads are ordinary word-level heads (the backbone kernel); every other group of heads attends, with
  its ordinary queries H W_Q (eq. 5), to a phrase memory of one granularity (eq. 4-7). All phrase groups run in one
  attention call (query length T, key length M phrase slots, boolean key mask over real phrases).
- The phrase memory of a group (`PhraseMemory`, batched over sentences and groups with segment/scatter ops, no
  Python loop over sentences or phrases):
  partition (n-gram ids derived from the attention mask, counted on the words: the closing `</s>` and a leading
  `<2xx>` tag belong to no phrase; or parse-level ids given as `phrase_index`) -> composition (`max_pool` | `san` |
  `lstm` d -> d_g, eq. 8) -> optional tag classifier on the composed phrases (eq. 9-10) -> interaction (`none` |
  `lstm` | `on_lstm`, eq. 11; a loop over the phrase steps, which are few; one traced `scan` when exported).
- The fused QKV holds keys and values only for the heads that project them (docs/variants-spec.md §3.2d): in the
  default `split` mode the phrase heads read K = V = slices of their memory and have no K/V rows.
- The tag loss (eq. 12) leaves the layer as an auxiliary loss SUM (`{"tag_loss": lambda * L_tag}`); the backbone
  divides it by the number of target tokens, adds it to `.loss` and reports it in `.aux_losses`.

Everything else (embeddings, word-level attention kernel, decoder, cache, generation) is the backbone's: MG-SA
is encoder-only, so incremental decoding is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache

from .compat_transformer_nmt import accepts_cache_alias
from .configuration_mgsa import MgsaConfig
from .modeling_transformer_nmt import (
    TransformerNmtAttention,
    TransformerNmtEncoder,
    TransformerNmtEncoderLayer,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    attend,
    real_tokens,
)
from .phrases import encode_by_leaves, ngram_phrase_index, phrase_inputs_from_leaves


# --------------------------------------------------------------------------------------------------- partitions
def source_words(real: torch.Tensor, leading_tag: bool) -> torch.Tensor:
    """[B, T] booleans: the real tokens without the special tokens every source carries at fixed places: the
    `</s>` the tokenizer appends (the last real token) and, when `leading_tag` (`config.target_language_tags`),
    the `<2xx>` tag prepended to it (the first real token). Padding on either side (docs/variants-spec.md §3.2a)."""
    rank = real.long().cumsum(-1) - 1
    length = real.sum(-1, keepdim=True)
    words = real & (rank != length - 1)
    if leading_tag:
        words = words & (rank != 0)
    return words


@dataclass
class PhrasePartition:
    """Phrase ids of every token for every group, computed once per encoder forward.

    `ids` [B, G, T]: phrase of each token (-1: none, e.g. padding); `mask` [B, G, M]: phrase slot m is a real
    phrase (has tokens); `sizes` [B, G, M]: tokens per phrase; `real` [B, T]: the real (non-padding) tokens;
    `tags` [B, G, M] constituent tag ids (-100: none) or None."""

    ids: torch.Tensor
    mask: torch.Tensor
    tags: torch.Tensor | None = None
    sizes: torch.Tensor | None = None
    real: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.mask.shape[-1]


def segment_layout(ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Flat slot index [B*G*T] of every (sentence, group, token) in a [B*G*M + 1] buffer; tokens without a phrase
    go to the last (dummy) slot, which callers drop."""
    b, g, _ = ids.shape
    base = torch.arange(b * g, device=ids.device).view(b, g, 1) * num_slots
    return torch.where(ids >= 0, base + ids, torch.full_like(ids, b * g * num_slots)).reshape(-1)


def segment_max(values: torch.Tensor, flat: torch.Tensor, slots: int) -> torch.Tensor:
    """Max over each slot's members: values [N, d] (one row per flat entry) -> [slots, d]; empty slots give 0."""
    index = flat[:, None].expand(-1, values.shape[-1])
    out = values.new_zeros(slots + 1, values.shape[-1])
    return out.scatter_reduce(0, index, values, reduce="amax", include_self=False)[:-1]


def segment_softmax(scores: torch.Tensor, flat: torch.Tensor, slots: int) -> torch.Tensor:
    """Softmax of `scores` [N] within each slot (float32): exp(s - max_slot) / sum_slot exp(s - max_slot)."""
    scores = scores.float()
    shift = scores.new_full((slots + 1,), float("-inf")).scatter_reduce(0, flat, scores.detach(), reduce="amax")
    exp = torch.exp(scores - shift[flat])
    denominator = scores.new_zeros(slots + 1).index_add(0, flat, exp)
    return exp / denominator[flat]


def cumax(logits: torch.Tensor) -> torch.Tensor:
    """cumsum(softmax(x)): a soft, monotonically non-decreasing 0 -> 1 gate (Shen et al. 2019)."""
    return torch.cumsum(torch.softmax(logits, dim=-1), dim=-1)


# ------------------------------------------------------------------------------------------------- recurrences
class PhraseRecurrence(nn.Module):
    """G independent (ON-)LSTMs run together (one per phrase group), over a masked sequence of steps.

    ON-LSTM follows yikangshen/Ordered-Neurons ON_LSTM.py without DropConnect: gates = W_ih x + b_ih + W_hh h +
    b_hh = [i~ logits (n_c), f~ logits (n_c), o, c^, i, f (hidden each)], n_c = hidden / chunk_size;
    f~ = cumax, i~ = 1 - cumax, broadcast over each chunk; w = f~ * i~; f^ = sigmoid(f) * w + (f~ - w);
    i^ = sigmoid(i) * w + (i~ - w); c = f^ * c + i^ * tanh(c^); h = sigmoid(o) * tanh(c). With `ordered=False` it is
    a plain LSTM with the same gate layout (no master gates). Masked steps keep the state unchanged, so padded
    phrases never change it and the last state is that of the last real step."""

    def __init__(self, num_groups: int, input_size: int, hidden_size: int, chunk_size: int = 1, ordered: bool = True):
        super().__init__()
        self.num_groups, self.input_size, self.hidden_size = num_groups, input_size, hidden_size
        self.ordered = ordered
        self.chunk_size = chunk_size
        self.num_chunks = hidden_size // chunk_size if ordered else 0
        gates = 4 * hidden_size + 2 * self.num_chunks
        self.weight_ih = nn.Parameter(torch.empty(num_groups, gates, input_size))
        self.bias_ih = nn.Parameter(torch.empty(num_groups, gates))
        self.weight_hh = nn.Parameter(torch.empty(num_groups, gates, hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(num_groups, gates))

    def step(self, projected: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor):
        """One step for all groups: projected input [N, G, gates], state [N, G, hidden] ->
        (hidden, cell, master gates (forget, input) [N, G, hidden] or None)."""
        gates = projected + torch.einsum("ngh,gkh->ngk", hidden, self.weight_hh) + self.bias_hh
        return self.update(gates, cell)

    def update(self, gates: torch.Tensor, cell: torch.Tensor):
        """The cell update from the step's gates [..., gates] and cell [..., hidden] (any leading layout) ->
        (hidden, cell, master gates or None)."""
        nc2 = 2 * self.num_chunks
        out_gate, candidate, in_gate, forget_gate = gates[..., nc2:].chunk(4, dim=-1)
        forget_gate, in_gate = torch.sigmoid(forget_gate), torch.sigmoid(in_gate)
        masters = None
        if self.ordered:
            master_in, master_forget = gates[..., :nc2].chunk(2, dim=-1)
            master_in, master_forget = 1.0 - cumax(master_in), cumax(master_forget)
            if self.chunk_size > 1:
                master_in = master_in.repeat_interleave(self.chunk_size, dim=-1)
                master_forget = master_forget.repeat_interleave(self.chunk_size, dim=-1)
            overlap = master_forget * master_in
            forget_gate = forget_gate * overlap + (master_forget - overlap)
            in_gate = in_gate * overlap + (master_in - overlap)
            masters = (master_forget, master_in)
        cell = forget_gate * cell + in_gate * torch.tanh(candidate)
        hidden = torch.sigmoid(out_gate) * torch.tanh(cell)
        return hidden, cell, masters

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """inputs [N, G, S, input_size], mask [N, G, S] -> states [N, G, S, hidden]."""
        projected = torch.einsum("ngsd,gkd->ngsk", inputs, self.weight_ih) + self.bias_ih[:, None]
        n, g, steps, _ = inputs.shape
        hidden = inputs.new_zeros(n, g, self.hidden_size)
        cell = torch.zeros_like(hidden)
        if torch.compiler.is_exporting():
            return self._scan(projected, mask, hidden, cell)
        outputs = []
        for s in range(steps):
            new_hidden, new_cell, _ = self.step(projected[:, :, s], hidden, cell)
            keep = mask[:, :, s, None]
            hidden = torch.where(keep, new_hidden, hidden)
            cell = torch.where(keep, new_cell, cell)
            outputs.append(hidden)
        return torch.stack(outputs, dim=2)

    def _scan(self, projected, mask, hidden, cell) -> torch.Tensor:
        """The loop of `forward` as one traced `scan` (ONNX `Scan`) over the step axis, for torch.export: a Python
        loop would be unrolled to the sample's step count. The recurrent product as one batched MatMul per step
        (exported, the einsum of `step` is a chain of reshapes run at every step)."""
        from torch._higher_order_ops.scan import scan

        weight = self.weight_hh.transpose(1, 2)  # [G, hidden, gates]

        def combine(state, step):
            recurrent = torch.matmul(state[0].transpose(0, 1), weight).transpose(0, 1)
            new_hidden, new_cell, _ = self.update(step[0] + recurrent + self.bias_hh, state[1])
            keep = step[1][:, :, None]
            state = (torch.where(keep, new_hidden, state[0]), torch.where(keep, new_cell, state[1]))
            return state, state[0].clone()

        _, outputs = scan(combine, (hidden, cell), (projected.movedim(2, 0), mask.movedim(2, 0)))
        return outputs.movedim(0, 2)


# ---------------------------------------------------------------------------------------------- phrase memory
class PhraseMemory(nn.Module):
    """F_h of eq. 4 for all phrase groups of one layer: composition (eq. 8), tag logits (eq. 9), interaction
    (eq. 11). Input H [B, T, d] and a `PhrasePartition`; output the memory [B, G, M, width] and the composed
    phrases G_x [B, G, M, d]."""

    def __init__(self, config: MgsaConfig):
        super().__init__()
        d, groups, d_g = config.d_model, config.num_phrase_groups, config.group_dim
        self.num_groups, self.group_dim = groups, d_g
        self.composition = config.phrase_composition
        self.interaction = config.phrase_interaction
        composed = config.composed_dim
        if self.composition == "san":  # W_Q^c, W_K^c in R^{d x d_g} per group, no value projection
            self.composition_query = nn.Parameter(torch.empty(groups, d, d_g))
            self.composition_key = nn.Parameter(torch.empty(groups, d, d_g))
        elif self.composition == "lstm":  # last hidden state of an LSTM (d -> d_g in split mode) over the phrase
            self.composition_lstm = PhraseRecurrence(groups, d, composed, ordered=False)
        # the longest phrase a partition can hold, where the config bounds it (n-gram phrases: the largest n)
        self.longest_phrase = max(config.ngram_sizes) if config.phrase_type == "ngram" else None
        self.recurrence = None
        if self.interaction != "none":
            self.recurrence = PhraseRecurrence(
                groups,
                composed,
                config.phrase_state_dim,
                config.on_lstm_chunk_size,
                ordered=self.interaction == "on_lstm",
            )

    def compose(self, hidden_states: torch.Tensor, partition: PhrasePartition) -> torch.Tensor:
        """g_m = COM(p_m) for every phrase of every group: [B, G, M, d] ([B, G, M, hidden] for the LSTM
        composition; 0 in empty slots)."""
        b, t, d = hidden_states.shape
        ids, slots = partition.ids, partition.num_slots
        if self.composition == "lstm":
            return self._compose_lstm(hidden_states, ids, slots)
        g = ids.shape[1]
        total = b * g * slots
        flat = segment_layout(ids, slots)
        members = hidden_states[:, None].expand(b, g, t, d).reshape(-1, d)  # one row per (sentence, group, token)
        pooled = segment_max(members, flat, total)  # [B*G*M, d]
        if self.composition == "max_pool":
            return pooled.view(b, g, slots, d)
        # SAN: the max-pooled vector queries the phrase's tokens; softmax restricted to members.
        query = torch.einsum("bgmd,gde->bgme", pooled.view(b, g, slots, d), self.composition_query)
        key = torch.einsum("btd,gde->bgte", hidden_states, self.composition_key)  # [B, G, T, d_g]
        query_of_token = query.gather(2, ids.clamp(min=0)[..., None].expand(-1, -1, -1, query.shape[-1]))
        scores = (query_of_token * key).sum(-1).reshape(-1) * key.shape[-1] ** -0.5
        weights = segment_softmax(scores, flat, total).to(hidden_states.dtype)
        composed = members.new_zeros(total + 1, d).index_add(0, flat, members * weights[:, None])
        return composed[:-1].view(b, g, slots, d)

    def _compose_lstm(self, hidden_states: torch.Tensor, ids: torch.Tensor, slots: int) -> torch.Tensor:
        """Run the group's LSTM over each phrase's tokens in order (all phrases as one batch of short sequences)
        and keep the last real state."""
        b, t, d = hidden_states.shape
        g = ids.shape[1]
        real = ids >= 0
        counts = torch.zeros(b, g, slots + 1, dtype=torch.long, device=ids.device)
        counts.scatter_add_(2, torch.where(real, ids, slots), torch.ones_like(ids))
        counts = counts[..., :slots]
        # rank of each token inside its phrase: stable sort by phrase id, minus the phrase's first sorted position
        key = torch.where(real, ids, slots) * t + torch.arange(t, device=ids.device)
        order = key.argsort(dim=-1)
        sorted_ids = torch.where(real, ids, slots).gather(-1, order)
        starts = F.pad(counts.cumsum(-1), (1, 0))[..., :-1]
        sorted_rank = torch.arange(t, device=ids.device) - starts.gather(-1, sorted_ids.clamp(max=slots - 1))
        rank = torch.empty_like(sorted_rank).scatter_(-1, order, sorted_rank)
        if torch.compiler.is_exporting() and self.longest_phrase is not None:
            # a traced graph cannot read the longest phrase from the data: run to the bound (masked steps keep the
            # state, so the last state is the same)
            length = self.longest_phrase
        else:
            length = max(int(counts.max()), 1)
        # one recurrence row per (sentence, slot), phrase-major, built flat: each sentence has slots + 1 rows, the
        # last collecting its tokens without a phrase (dropped); no slicing and merging of the symbolic slot axis,
        # which torch.export would specialize
        rows = slots + 1
        row = torch.arange(b, device=ids.device)[:, None, None] * rows + torch.where(real, ids, slots)  # [B, G, T]
        gi = torch.arange(g, device=ids.device)[None, :, None].expand_as(ids)
        sequences = hidden_states.new_zeros(b * rows, g, length, d)
        sequences[row, gi, rank.clamp(max=length - 1)] = hidden_states[:, None].expand(b, g, t, d)
        sizes = torch.zeros(b * rows, g, dtype=torch.long, device=ids.device)
        sizes.index_put_((row, gi), torch.ones_like(ids), accumulate=True)
        mask = torch.arange(length, device=ids.device) < sizes[..., None]
        last = self.composition_lstm(sequences, mask)[:, :, -1]  # masked steps keep the state: last real one
        return last.view(b, rows, g, last.shape[-1])[:, :slots].transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, partition: PhrasePartition):
        composed = self.compose(hidden_states, partition)
        memory = composed if self.recurrence is None else self.recurrence(composed, partition.mask)
        return memory, composed


# -------------------------------------------------------------------------------------------------- attention
class MgsaSelfAttention(TransformerNmtAttention):
    """Encoder self-attention with word heads and phrase heads (eq. 5-7), on the backbone's fused QKV and output
    projections. The fused QKV holds queries for every head and keys/values for the heads that project them: the
    word heads, and the phrase heads when they project their memory (no interaction, or
    `mgsa_phrase_kv="project"`: eq. 5). Phrase heads reading slices of a d_g-wide memory (`split` mode) have no
    K/V rows (`qkv_proj` has d + 2 * word_heads * head_dim outputs); a model saved with those rows
    (`phrase_kv_rows="all"`, hf_variants <= 0.2) gets them sliced away by `drop_unused_kv_rows()`."""

    def __init__(self, config: MgsaConfig, num_heads: int, layer_idx: int | None = None, **kwargs):
        super().__init__(config, num_heads, layer_idx, **kwargs)
        self.num_groups = config.num_phrase_groups
        self.word_heads = config.word_heads
        self.heads_per_group = config.heads_per_group
        self.project_kv = config.phrase_heads_project_kv
        self.phrase_memory = PhraseMemory(config) if self.num_groups else None
        # K/V rows for the word heads only (the phrase heads' K and V are their memory slices)
        self.word_kv_only = bool(self.num_groups) and not self.project_kv
        if self.word_kv_only and config.phrase_kv_rows == "used":
            self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.word_heads * self.head_dim)
        self.tag_loss_weight = config.tag_loss_weight
        self.tag_classifiers = None
        if self.num_groups and config.uses_tag_loss:
            count = 1 if config.tag_classifier == "shared" else self.num_groups
            labels = len(config.tag_labels)
            self.tag_classifiers = nn.ModuleList([nn.Linear(config.composed_dim, labels) for _ in range(count)])

    @property
    def has_unused_kv_rows(self) -> bool:
        """Whether `qkv_proj` still holds K/V rows for phrase heads that never read them (0.1/0.2 layout)."""
        return self.word_kv_only and self.qkv_proj.out_features == 3 * self.embed_dim

    @torch.no_grad()
    def drop_unused_kv_rows(self) -> None:
        """Replace a full `qkv_proj` [3d, d] by its used rows [d + 2 w D, d] (queries of every head, keys and values
        of the w word heads), the same values: outputs are unchanged."""
        if not self.has_unused_kv_rows:
            return
        d, word = self.embed_dim, self.word_heads * self.head_dim
        rows = torch.cat([torch.arange(d + word), 2 * d + torch.arange(word)]).to(self.qkv_proj.weight.device)
        old = self.qkv_proj
        new = nn.Linear(d, d + 2 * word, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        new.weight.copy_(old.weight[rows])
        if old.bias is not None:
            new.bias.copy_(old.bias[rows])
        new.weight.requires_grad_(old.weight.requires_grad)
        self.qkv_proj = new

    def _queries_and_word_keys_values(self, hidden_states: torch.Tensor):
        """Queries [B, H, T, D] of every head, keys and values [B, w, T, D] of the word heads."""
        b, t, d = hidden_states.shape
        w, head_dim = self.word_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)
        if qkv.shape[-1] == 3 * d:
            query, key, value = self._heads(qkv, 3)
            return query, key[:, :w], value[:, :w]
        query, key, value = qkv.split([d, w * head_dim, w * head_dim], dim=-1)

        def heads(x, n):
            return x.view(b, t, n, head_dim).transpose(1, 2)

        return heads(query, self.num_heads), heads(key, w), heads(value, w)

    def tag_logits(self, composed: torch.Tensor) -> torch.Tensor:
        """p(t_m) logits (eq. 9) on the composed phrases [B, G, M, d] -> [B, G, M, labels]."""
        if len(self.tag_classifiers) == 1:
            return self.tag_classifiers[0](composed)
        return torch.stack([clf(composed[:, i]) for i, clf in enumerate(self.tag_classifiers)], dim=1)

    def _phrase_keys_values(self, memory: torch.Tensor):
        """Phrase memory [B, G, M, width] -> keys, values [B, G*h_g, M, head_dim]."""
        b, g, m, _ = memory.shape
        if self.project_kv:  # eq. 5: K = M W_K^h, V = M W_V^h with the phrase heads' rows of the fused QKV
            # (through the module, so that adapters or quantized replacements of `qkv_proj` apply here too)
            d, first, width = self.embed_dim, self.word_heads * self.head_dim, self.heads_per_group * self.head_dim
            _, key, value = self.qkv_proj(memory).split(d, dim=-1)  # [B, G, M, d] each
            groups = torch.arange(g, device=memory.device)
            columns = (first + groups[:, None] * width + torch.arange(width, device=memory.device))[None, :, None]
            key = key.gather(-1, columns.expand(b, g, m, width))
            value = value.gather(-1, columns.expand(b, g, m, width))
        else:  # K = V = the head's slice of the recurrent state (no projection)
            key = value = memory

        def heads(x):
            return (
                x.view(b, g, m, self.heads_per_group, self.head_dim)
                .permute(0, 1, 3, 2, 4)
                .reshape(b, g * self.heads_per_group, m, self.head_dim)
            )

        return heads(key), heads(value)

    def _project(
        self,
        hidden_states,
        key_value_states=None,
        cache=None,
        mgsa_phrases: PhrasePartition | None = None,
        **kwargs,
    ):
        """Queries of every head; keys and values of the word heads, then of the phrase heads, each token's those of
        its phrase (the phrase memory F_h, eq. 4-5); the composed phrases go to `_attend` (the tag loss)."""
        if self.phrase_memory is None:
            return super()._project(hidden_states, key_value_states, cache, **kwargs)
        if mgsa_phrases is None:
            raise ValueError("MG-SA layers need the phrase partition built by MgsaEncoder (run the whole encoder).")
        query, key, value = self._queries_and_word_keys_values(hidden_states)  # key, value: the w word heads
        memory, composed = self.phrase_memory(hidden_states, mgsa_phrases)
        phrase_key, phrase_value = self._phrase_keys_values(memory)  # [B, P, M, D], P = G * h_g phrase heads
        # Every head in ONE kernel call over the T tokens: a phrase head sees token j through its phrase m(j), with
        # key k_m(j), value v_m(j) (and in `_attend` the score bias -log |m(j)|)
        ids = mgsa_phrases.ids.repeat_interleave(self.heads_per_group, dim=1)  # [B, P, T]
        index = ids.clamp(min=0)[..., None].expand(-1, -1, -1, self.head_dim)
        key = torch.cat([key, phrase_key.gather(2, index)], dim=1)
        value = torch.cat([value, phrase_value.gather(2, index)], dim=1)
        return query, key, value, {"composed": composed}

    def _attend(
        self,
        query,
        key,
        value,
        attention_mask,
        output_attentions=False,
        mgsa_phrases: PhrasePartition | None = None,
        composed: torch.Tensor | None = None,
        **kwargs,
    ):
        """The word and phrase heads in one kernel call: a phrase head's score of token j gets the bias
        -log |m(j)|, so that its softmax over tokens is p(m | t) / |m| (eq. 6) on each of m's tokens and its output
        sum_m p(m | t) v_m: the attention of eq. 6-7 over the phrase slots, returned as token-level weights
        [B, H, T, T] (a phrase's weight spread evenly). Aux: the tag loss SUM (eq. 12)."""
        if self.phrase_memory is None:
            return super()._attend(query, key, value, attention_mask, output_attentions=output_attentions, **kwargs)
        b, t, w = query.shape[0], query.shape[2], self.word_heads
        ids = mgsa_phrases.ids.repeat_interleave(self.heads_per_group, dim=1)  # [B, P, T]
        # The phrase heads' own key mask (tokens without a phrase: padding, special tokens) goes into the bias as the
        # dtype's minimum, so the stack's padding mask serves every head in any implementation's format.
        sizes = mgsa_phrases.sizes.repeat_interleave(self.heads_per_group, dim=1).gather(2, ids.clamp(min=0))
        phrase_bias = torch.where(
            ids >= 0, -torch.log(sizes.clamp(min=1).to(query.dtype)), torch.finfo(query.dtype).min
        )
        bias = torch.cat([phrase_bias.new_zeros(b, w, t), phrase_bias], dim=1)
        table = None
        if self.relative_positions is not None:  # word heads only: phrases have no token positions
            word_table = self.relative_positions.embeddings.weight
            table = torch.cat(
                [word_table.expand(w, *word_table.shape), word_table.new_zeros(self.num_heads - w, *word_table.shape)]
            )
        out, weights = attend(
            self,
            query,
            key,
            value,
            attention_mask,
            bias=bias[:, :, None, :],
            relative_table=table,
            max_relative_positions=self.config.max_relative_positions,
            relative_values=self.config.relative_position_values,
            is_causal=False,
            output_attentions=output_attentions,
        )
        aux = {}
        if self.tag_classifiers is not None and mgsa_phrases.tags is not None:
            logits = self.tag_logits(composed)
            tag_loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                mgsa_phrases.tags.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            aux["tag_loss"] = self.tag_loss_weight * tag_loss
        return out, weights, aux


# ------------------------------------------------------------------------------------------------------ layers
class MgsaEncoderLayer(TransformerNmtEncoderLayer):
    """An encoder layer whose self-attention is MG-SA (its tag loss leaves the layer as the backbone's aux)."""

    attention_class = MgsaSelfAttention


# ------------------------------------------------------------------------------------------------------ models
class MgsaPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = MgsaConfig
    _no_split_modules = ["MgsaEncoderLayer", "TransformerNmtEncoderLayer", "TransformerNmtDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, PhraseMemory) and module.composition == "san":
            d, d_g = module.composition_query.shape[1:]
            bound = math.sqrt(6.0 / (d + d_g))  # Xavier-uniform of each group's d x d_g matrix
            init.uniform_(module.composition_query, -bound, bound)
            init.uniform_(module.composition_key, -bound, bound)
        elif isinstance(module, PhraseRecurrence):  # the LSTM default: U(-1/sqrt(hidden), 1/sqrt(hidden))
            bound = module.hidden_size**-0.5
            for param in (module.weight_ih, module.bias_ih, module.weight_hh, module.bias_hh):
                init.uniform_(param, -bound, bound)
        elif isinstance(module, MgsaSelfAttention) and module.word_kv_only and self.config.init_method == "xavier":
            # the rows of a fused [3d, d] QKV keep the Xavier bound of the full matrix (as in the baseline)
            d = module.embed_dim
            bound = math.sqrt(6.0 / (d + 3 * d))
            init.uniform_(module.qkv_proj.weight, -bound, bound)

    def _after_load(self) -> None:
        """A checkpoint saved with K/V rows for phrase heads that never use them (`phrase_kv_rows="all"`,
        hf_variants <= 0.2) loads as saved and then has those rows sliced away (a load-time slice: same outputs,
        fewer parameters; `save_pretrained` then writes the new layout)."""
        self.drop_unused_kv_rows()

    def drop_unused_kv_rows(self) -> None:
        """Slice away the K/V rows of the fused QKV that no head reads (`phrase_kv_rows="all"` -> `"used"`)."""
        if getattr(self.config, "phrase_kv_rows", "used") != "all":
            return
        for module in self.modules():
            if isinstance(module, MgsaSelfAttention):
                module.drop_unused_kv_rows()
        self.config.phrase_kv_rows = "used"


# ----------------------------------------------------------------------------------------------------- encoder
class MgsaEncoder(MgsaPreTrainedModel, TransformerNmtEncoder):
    """The backbone encoder with MG-SA layers at `config.mgsa_layers`; builds the phrase partition once per
    forward. `phrase_index` / `phrase_tags` are named inputs (generate() validates and beam-expands them)."""

    def _make_layer(self, config: MgsaConfig, layer_idx: int) -> nn.Module:
        if layer_idx in config.mgsa_layers:
            return MgsaEncoderLayer(config, layer_idx)
        return TransformerNmtEncoderLayer(config, layer_idx)

    def phrase_partition(
        self, attention_mask, length: int, batch: int, device, phrase_index=None, phrase_tags=None
    ) -> PhrasePartition:
        config = self.config
        real = real_tokens(attention_mask, length)
        if real is None:
            real = torch.ones(batch, length, dtype=torch.bool, device=device)
        if config.phrase_type == "ngram":
            if phrase_index is not None or phrase_tags is not None:
                raise ValueError(
                    "`phrase_index` / `phrase_tags` are inputs of the syntactic MG-SA "
                    "(phrase_type='syntactic'); n-gram phrases come from the attention mask."
                )
            words = real
            if config.ngram_skip_special_tokens:  # the closing </s> and a leading <2xx> tag belong to no phrase
                words = source_words(real, config.target_language_tags)
            ids = ngram_phrase_index(words, config.ngram_sizes)
            # ceil(length / n) on non-negative operands: exported, a SymInt floor division becomes ONNX `Div`,
            # which truncates (-(-length // n) would give 0 slots for one token)
            n = min(config.ngram_sizes)
            slots = (length + n - 1) // n
        else:
            levels = config.syntactic_levels
            if phrase_index is None:
                raise ValueError(
                    "The syntactic MG-SA needs `phrase_index` [batch, levels, length] (and `phrase_tags` for the tag "
                    "loss): build them from parses with `model.prepare_translation_inputs(tokenizer, texts, "
                    "parses=[...])`, or pass `parses=` to the translation pipeline. A model to train without "
                    "parses takes the n-gram form: MgsaConfig(phrase_type='ngram') (train.py: --config_overrides "
                    "phrase_type=ngram)."
                )
            if (
                phrase_index.dim() != 3
                or phrase_index.shape[0] != batch
                or phrase_index.shape[1] != levels
                or phrase_index.shape[2] < length
            ):
                raise ValueError(
                    f"`phrase_index` must have shape [batch={batch}, syntactic_levels={levels}, "
                    f">= length={length}], got {tuple(phrase_index.shape)}."
                )
            ids = phrase_index[..., :length].to(device=device, dtype=torch.long)
            ids = torch.where(real[:, None, :], ids, torch.full_like(ids, -1))
            if torch.compiler.is_exporting():
                # a traced graph cannot size an axis from the values: the phrases of a level are numbered 0.. over
                # the tokens present (`phrase_inputs_from_leaves`), so there are at most `length`; the extra slots
                # are empty (masked: no token reads them, the recurrence keeps its state over them)
                slots = length
            else:
                slots = max(int(ids.max()) + 1, 1) if ids.numel() else 1
        counts = torch.zeros(ids.shape[0], ids.shape[1], slots + 1, dtype=torch.long, device=device)
        counts.scatter_add_(2, torch.where(ids >= 0, ids, slots), torch.ones_like(ids))
        sizes = counts[..., :slots]
        mask = sizes > 0
        tags = None
        if phrase_tags is not None and config.uses_tag_loss:
            tags = phrase_tags.to(device=device, dtype=torch.long)[..., :slots]
            tags = F.pad(tags, (0, slots - tags.shape[-1]), value=-100).masked_fill(~mask, -100)
        return PhrasePartition(ids=ids, mask=mask, sizes=sizes, real=real, tags=tags)

    def layer_inputs(self, attention_mask, hidden_states, phrase_index=None, phrase_tags=None, **kwargs) -> dict:
        """The phrase partition of the batch, built once per forward from the 2-D padding mask (n-gram phrases) or
        the parse-derived `phrase_index` (syntactic phrases), for every MG-SA layer."""
        if not (self.config.mgsa_layers and self.config.num_phrase_groups):
            return {}
        batch, length = hidden_states.shape[:2]
        return {
            "mgsa_phrases": self.phrase_partition(
                attention_mask, length, batch, hidden_states.device, phrase_index, phrase_tags
            )
        }

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        phrase_index=None,
        phrase_tags=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        """`phrase_index` / `phrase_tags` (syntactic MG-SA) are named so that `generate` passes and expands them."""
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
            phrase_index=phrase_index,
            phrase_tags=phrase_tags,
            **kwargs,
        )


class MgsaModel(MgsaPreTrainedModel, TransformerNmtModel):
    encoder_class = MgsaEncoder


class MgsaForConditionalGeneration(MgsaPreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin):
    base_model_class = MgsaModel

    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        phrase_index: torch.LongTensor | None = None,
        phrase_tags: torch.LongTensor | None = None,
        **kwargs,
    ):
        """The backbone's forward with the syntactic MG-SA's inputs named (Trainer keeps the dataset columns a
        forward names): `phrase_index` [B, levels, T] (phrase of every token, -1: none) and `phrase_tags`
        [B, levels, M] (constituent label of every phrase, for the tag loss), from
        `prepare_translation_inputs(..., parses=...)`. The n-gram MG-SA takes neither."""
        if phrase_index is not None:
            kwargs["phrase_index"] = phrase_index
        if phrase_tags is not None:
            kwargs["phrase_tags"] = phrase_tags
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
            **kwargs,
        )

    def _encode_sources(
        self,
        tokenizer,
        texts: list[str],
        prefixes: list[str],
        text_target: list[str] | None,
        max_length: int | None,
        parses: Sequence | Mapping[str, object] | None = None,
        **variant_kwargs,
    ) -> dict[str, torch.Tensor]:
        """The backbone's inputs plus, for syntactic MG-SA, `phrase_index` and `phrase_tags` built from `parses`
        (`prepare_translation_inputs(..., parses=...)`): one bracketed parse (or `nltk.Tree`) per sentence, as a
        list aligned with `texts` or a mapping from sentence to parse. The source is tokenized leaf by leaf
        (`phrases.encode_by_leaves`), once: a token never spans two leaves, so every leaf of the parse keeps tokens,
        its phrases and their tags (the ids equal `tokenizer(text)` where no subword crosses a leaf boundary);
        subword pieces share their word's phrase; the `<2xx>` tag and special tokens belong to no phrase. A parse
        whose leaves do not spell its sentence raises a `ValueError`."""
        config = self.config
        if not (config.phrase_type == "syntactic" and config.num_phrase_groups and config.mgsa_layers):
            if parses is not None:
                raise ValueError("`parses` are only used by the syntactic MG-SA (phrase_type='syntactic').")
            return super()._encode_sources(tokenizer, texts, prefixes, text_target, max_length, **variant_kwargs)
        if variant_kwargs:
            raise ValueError(
                f"{type(self).__name__} takes no extra inputs but `parses`, got {sorted(variant_kwargs)}."
            )
        if parses is None:
            raise ValueError(
                "The syntactic MG-SA needs one constituency parse per source sentence: pass "
                "`parses=[...]` (bracketed strings or nltk.Tree), aligned with the sentences."
            )
        if isinstance(parses, Mapping):
            missing = [text for text in texts if text not in parses]
            if missing:
                raise ValueError(f"No parse given for the sentence {missing[0]!r}.")
            parses = [parses[text] for text in texts]
        elif isinstance(parses, str):
            parses = [parses]
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("Syntactic MG-SA inputs need a fast tokenizer (its `tokenizers` backend).")
        source = [prefix + text for prefix, text in zip(prefixes, texts)]
        ids, leaves, trees = encode_by_leaves(
            tokenizer, source, parses, starts=[len(p) for p in prefixes], max_length=max_length
        )
        padded = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        length = padded["input_ids"].shape[1]
        left = getattr(tokenizer, "padding_side", "right") == "left"
        leaves = [[-1] * (length - len(row)) + row if left else row + [-1] * (length - len(row)) for row in leaves]
        inputs = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
        if text_target is not None:  # the labels alone: what `tokenizer(sources, text_target=...)` gives as labels
            inputs["labels"] = tokenizer(
                text_target=text_target,
                padding=True,
                truncation=max_length is not None,
                max_length=max_length,
                return_tensors="pt",
            )["input_ids"]
        inputs.update(phrase_inputs_from_leaves(trees, leaves, config.syntactic_levels, config.tag_labels))
        return inputs


__all__ = [
    "MgsaPreTrainedModel",
    "MgsaModel",
    "MgsaForConditionalGeneration",
    "MgsaSelfAttention",
    "MgsaEncoderLayer",
    "MgsaEncoder",
    "PhraseMemory",
    "PhraseRecurrence",
    "PhrasePartition",
]
