# batchmaker on NVIDIA GPUs, one worker per GPU the container sees. Build from the repository root:
#   docker build -f deploy/cuda.Dockerfile -t batchmaker:cuda .
# BATCHMAKER_TORCH chooses the torch build scripts/_env.sh installs; it must match the CUDA version of the base.
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ARG BATCHMAKER_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN BATCHMAKER_TORCH="$BATCHMAKER_TORCH" BATCHMAKER_EXTRAS=oip bash -c 'source scripts/_env.sh' && rm -rf /root/.cache/pip \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin batchmaker

ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10001
EXPOSE 5555 8000 8001 9100
ENTRYPOINT ["batchmaker"]
CMD ["serve", "/etc/batchmaker/config.toml", "--log-format", "json"]
