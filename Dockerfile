# The ext_proc server and the simulated providers. Envoy and Redis come from their official images.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY irislab ./irislab
COPY envoy ./envoy
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT ["iris-extproc"]
CMD ["serve", "--config", "/app/envoy/example-config.yaml"]
