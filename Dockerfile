# One image for every gpuorch service; compose.yaml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir .
ENTRYPOINT ["gpuorch"]
