# cronlock: slim, non-root. The image holds the library's wheel and this repository's service
# shell (app/), and runs `python -m app serve` (uvicorn with the app factory).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cronlock ./cronlock
COPY app ./app
# With both trigger schemes' libraries (TRIGGER_AUTH=oidc, qstash): the image is the service.
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[oidc,qstash]'

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 LOG_FORMAT=json
RUN useradd --system --uid 10001 --home-dir /app cronlock
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY --from=build /src/app /app/app
USER cronlock
WORKDIR /app
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"
# `serve` runs uvicorn with the app factory, no access log, and GRACEFUL_SHUTDOWN_TIMEOUT as
# uvicorn's graceful shutdown (uvicorn alone waits for ever for requests in flight). Give the
# container DATABASE_URL and CRON_SECRET or CRON_SECRET_FILE: without them `serve` would try to
# start an embedded PostgreSQL or to write a secret into /app/var, neither of which this image
# is set up for (no PostgreSQL binaries; /app is not writable).
CMD ["python", "-m", "app", "serve", "--host", "0.0.0.0", "--port", "8000"]
