"""`python -m vllm_engine.embedded_model`: build the default embedded model (if missing) and
print its directory. install.sh runs it so a fresh machine trains the model once, up front."""

from vllm_engine.embedded_model.build import ensure_embedded_model

print(ensure_embedded_model())
