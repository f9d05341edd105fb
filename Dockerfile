# docker build -t feedrate .
# docker run --gpus all --shm-size=8g feedrate                      # the default run, on the GPU
# docker run --gpus all --shm-size=8g -v "$PWD/outputs:/app/outputs" feedrate \
#     python train.py -m sweep=loader                                # tune; results on the host
#
# --shm-size matters: DataLoader workers hand batches to the training process through
# /dev/shm, and Docker's default of 64 MB fails ("Bus error", "insufficient shared memory")
# as soon as a few workers prefetch images. --ipc=host works too.
FROM mambaorg/micromamba:2.0.5

# The environment first, from environment.yml alone: rebuilt only when it changes.
COPY --chown=$MAMBA_USER:$MAMBA_USER environment.yml /tmp/environment.yml
RUN micromamba install --yes --name base --file /tmp/environment.yml \
    && micromamba clean --all --yes

USER root
RUN mkdir -p /app/outputs && chown -R $MAMBA_USER:$MAMBA_USER /app
USER $MAMBA_USER
WORKDIR /app
COPY --chown=$MAMBA_USER:$MAMBA_USER pyproject.toml README.md train.py ./
COPY --chown=$MAMBA_USER:$MAMBA_USER src ./src
COPY --chown=$MAMBA_USER:$MAMBA_USER conf ./conf
COPY --chown=$MAMBA_USER:$MAMBA_USER examples ./examples
ARG MAMBA_DOCKERFILE_ACTIVATE=1
RUN pip install --no-deps --no-cache-dir -e .

CMD ["python", "train.py"]
