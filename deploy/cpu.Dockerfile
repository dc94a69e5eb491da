# batchmaker on CPU workers. Build from the repository root:
#   docker build -f deploy/cpu.Dockerfile -t batchmaker:cpu .
# The project is installed by its own scripts/_env.sh (a virtualenv in /app/.venv, the CPU build of torch),
# with the front door's oip extra and without the test and bench extras.
FROM python:3.11-slim

WORKDIR /app
COPY . /app
RUN BATCHMAKER_EXTRAS=oip bash -c 'source scripts/_env.sh' && rm -rf /root/.cache/pip \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin batchmaker

ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10001
# 5555: clients (ZeroMQ); 8000, 8001: the front door (HTTP, gRPC); 9100: /metrics, /healthz, /readyz
EXPOSE 5555 8000 8001 9100
ENTRYPOINT ["batchmaker"]
CMD ["serve", "/etc/batchmaker/config.toml", "--log-format", "json"]
