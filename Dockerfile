# docker build -t feedrate .
# docker run --gpus all --shm-size=8g feedrate                          # the default run
# docker run --gpus all --shm-size=8g --user "$(id -u):$(id -g)" -v "$PWD:/project" \
#     feedrate feedrate sweep                                           # tune, in your project
#
# Mount your project at /project, and run as yourself (--user): outputs/ and the preset a
# sweep writes (conf/loader/<name>.yaml) land in it, yours to keep, and your own dataset
# classes and configs there are found (feedrate train dataset=custom dataset._target_=...).
# --shm-size matters: DataLoader workers hand batches to the training process through
# /dev/shm, and Docker's default of 64 MB fails ("Bus error", "insufficient shared memory")
# as soon as a few workers prefetch images. --ipc=host works too.
FROM mambaorg/micromamba:2.0.5

# The environment first, from environment.yml alone: rebuilt only when it changes.
COPY --chown=$MAMBA_USER:$MAMBA_USER environment.yml /tmp/environment.yml
RUN micromamba install --yes --name base --file /tmp/environment.yml \
    && micromamba clean --all --yes

# feedrate itself, installed (not editable): its configs ship in the package.
COPY --chown=$MAMBA_USER:$MAMBA_USER pyproject.toml README.md LICENSE /tmp/feedrate/
COPY --chown=$MAMBA_USER:$MAMBA_USER src /tmp/feedrate/src
COPY --chown=$MAMBA_USER:$MAMBA_USER conf /tmp/feedrate/conf
ARG MAMBA_DOCKERFILE_ACTIVATE=1
RUN pip install --no-deps --no-cache-dir /tmp/feedrate && rm -rf /tmp/feedrate

# The examples (examples.sleepy.SleepyDataset ...) import from anywhere; any user can write
# the project directory and the home (the photo cache: ~/.cache/feedrate).
USER root
COPY examples /opt/feedrate/examples
RUN mkdir -p /project /home/feedrate && chmod 1777 /project /home/feedrate
ENV HOME=/home/feedrate PYTHONPATH=/opt/feedrate
USER $MAMBA_USER
WORKDIR /project

CMD ["feedrate", "train"]
