# The image charts/warmroute runs (gateway and agent containers): `warmroute` is the entrypoint,
# the chart passes `gateway ...` or `agent ...` as arguments.
#   docker build -t ghcr.io/example/warmroute:0.1.0 .
# The install step is the one the tests run (pip install of this package; tests/test_chart_run.py
# runs the rendered containers against such an install), then the built-in tokenizer is built
# once at image build time so that the read-only root filesystem never needs to hold it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    WARMROUTE_CACHE_DIR=/opt/warmroute/cache

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY replica_agent ./replica_agent
COPY hashing ./hashing
COPY policies ./policies
COPY loadtests ./loadtests
RUN pip install . \
 && python -c "from gateway.default_tokenizer import default_tokenizer_dir; print(default_tokenizer_dir())" \
 && chmod -R a+rX /opt/warmroute/cache \
 && rm -rf /src

# The uid/gid the chart's securityContext runs as (gateway.podSecurityContext.runAsUser).
RUN groupadd --system --gid 10001 warmroute \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin warmroute
USER 10001:10001
WORKDIR /

EXPOSE 8080 8081 9090
ENTRYPOINT ["warmroute"]
CMD ["--help"]
