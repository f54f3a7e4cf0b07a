#!/bin/sh
# Run by the image build as root (bentofile.yaml: docker.setup_script): the rollout state's directory, owned by the
# user the server runs as, so a named volume mounted there (podman/docker copy an empty volume's ownership from the
# image) or a Kubernetes volume is writable and the rollout state survives the container.
set -eu
mkdir -p /home/bentoml/state
chown bentoml:bentoml /home/bentoml/state
