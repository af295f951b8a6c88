"""The HTTP translation service (`hf-variants-serve`, the `serve` extra: FastAPI + uvicorn + prometheus_client,
sentencex, python-multipart, swagger-ui-bundle). Its command line is `hf_variants.commands.serve`.

- `app`: the FastAPI application (routes, the model's loading and warm-up, the drain), on the translation core
  (`hf_variants.inference.Translator`);
- `access`: the middleware in front of every route (hosts, origins, API keys, rate limits, request ids, access log);
- `prepare`: a request made ready off the event loop (parsed, split into sentences, options resolved, tokenized
  once) and its answer; `responses`: JSON answers and the body read within its limits;
- `batcher`: dynamic batching of the sentences of concurrent requests (settings groups, lanes, cancellation);
- `protocol`: the connection handling (timeouts, connection cap, lingering close) under uvicorn;
- `libretranslate`: the LibreTranslate-compatible mount; `docs`: the Swagger page with local assets;
- `limits`: the limits and the checks of a request body; `schema`: the JSON bodies (OpenAPI);
- `logs`: text and JSON log lines; `metrics`: the Prometheus metrics; `page.html`: the page at `/`.

docs/serving.md is the operator's page. Nothing in the translation core or in a saved model's code imports this
package.
"""
