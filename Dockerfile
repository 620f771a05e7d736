# The image the manifests of `engine k8s` run (engine/launch/k8s.py). From the repository root:
#   docker build -t REGISTRY/sparse-engine:TAG .
#   docker push REGISTRY/sparse-engine:TAG
#   engine k8s configs/ctr.yaml --image REGISTRY/sparse-engine:TAG --out k8s/
# The package and its dependencies (all wheels: numpy, numba, grpcio, pyarrow, rocksdict, ...), no
# compiler, no tests, no data. Runs as the non-root user 10001 (the manifests' runAsUser); the root
# filesystem can be read-only: the manifests give /tmp and the working directory as emptyDirs.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache

WORKDIR /opt/sparse-engine-src
COPY pyproject.toml README.md constraints.txt ./
COPY engine ./engine
COPY sparse_tables ./sparse_tables
COPY models ./models
COPY streaming ./streaming
COPY hdfs_io ./hdfs_io
RUN pip install --no-cache-dir -c constraints.txt . \
    && cd / && rm -rf /opt/sparse-engine-src \
    && groupadd --system --gid 10001 engine \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/engine --shell /usr/sbin/nologin engine \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/engine

WORKDIR /var/lib/engine
USER 10001:10001
ENTRYPOINT ["engine"]
CMD ["--help"]
