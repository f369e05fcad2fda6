# steprecord: build the wheel and install it in a virtualenv in one stage, run it as an
# unprivileged user in the next. The install is the one CI proves (.ci/release-check): the
# wheel from `pip wheel`, installed with its dependencies, no source tree beside it.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir /dist/steprecord-*.whl

FROM python:3.11-slim
RUN useradd --system --create-home --uid 10001 steprecord
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/steprecord
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
# Configure with DATABASE_URL; migrate, then create a token (`steprecord migrate`, then
# `steprecord token create`; neither `token` nor `prune` migrates) or the
# service refuses to listen on a public address without one.
# It serves plain HTTP: in production run it behind a TLS-terminating proxy or load balancer.
ENTRYPOINT ["steprecord"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
