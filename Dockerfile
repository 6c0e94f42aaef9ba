# tierchain serve in a container: non-root, health-checked on /readyz.
# Build:  docker build -t tierchain .
# Run:    docker run -p 8080:8080 -v "$PWD/routes.toml:/etc/tierchain/routes.toml:ro" tierchain
# See docs/container.md (a compose file with Redis beside it).
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/tierchain-*.whl)[serve,redis]" \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tierchain
ENV PYTHONUNBUFFERED=1 \
    TIERCHAIN_HOST=0.0.0.0 \
    TIERCHAIN_PORT=8080 \
    TIERCHAIN_ROUTES_FILE=/etc/tierchain/routes.toml
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('TIERCHAIN_PORT', '8080'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tierchain"]
CMD ["serve"]
