# The ext_proc server and the simulated providers. Envoy and Redis come from their official images.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY irislab ./irislab
COPY envoy ./envoy
# opentelemetry-proto last: xds-protos ships an old copy of its modules (grpc/grpc#42926)
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --force-reinstall --no-deps \
      "opentelemetry-proto==$(python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
USER nobody
ENTRYPOINT ["iris-extproc"]
CMD ["serve", "--config", "/app/envoy/example-config.yaml"]
