"""What the processes of a run exchange outside the training step (Accelerate's collectives, a no-op with one
process)."""

from __future__ import annotations


def accelerator_broadcast(accelerator, obj):
    """The main process's `obj` on every process."""
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj if accelerator.is_main_process else None]
    broadcast_object_list(box, from_process=0)
    return box[0]


__all__ = ["accelerator_broadcast"]
