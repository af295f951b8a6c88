"""The HTTP translation service (`hf-variants-serve`, the `serve` extra: FastAPI + uvicorn + prometheus_client).

- `cli`: the command, its flags and checks, the uvicorn server and its graceful stop;
- `app`: the FastAPI application (routes, access control, loading and warm-up), on the translation core
  (`hf_variants.inference.Translator`);
- `batcher`: dynamic batching of the sentences of concurrent requests;
- `limits`: the limits and the checks of a request body; `schema`: the JSON bodies (OpenAPI);
- `metrics`: the Prometheus metrics; `page.html`: the page at `/`.

Nothing in the translation core or in a saved model's code imports this package.
"""
