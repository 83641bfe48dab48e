#!/usr/bin/env bash
# What `docker-compose up` needs on a machine that has no Docker yet, or reaches no container
# registry (deploy/README.md "Docker Compose"). Each step runs only where its result is missing:
#   1. Docker Engine, docker-compose and debootstrap from the distribution's packages (apt, as root);
#   2. a running Docker daemon (started in the background, its log in $CENTERLINE_DOCKERD_LOG);
#   3. the base image $CENTERLINE_BASE_IMAGE (default centerline-base:bookworm): a Debian root file
#      system built by debootstrap from this machine's Debian mirror, with Python in a virtual
#      environment on PATH (as the official python images have pip on PATH) and this machine's CA
#      bundle, so that pip inside a build trusts what pip here trusts.
#   4. the repository's `.env` (compose's variables; git-ignored): CENTERLINE_BASE_IMAGE names that
#      base image, and CENTERLINE_TORCH_INDEX_URL is left empty (pip's own index) where PyTorch's
#      CPU index does not answer. Other lines of `.env` are kept.
# Then `docker-compose up -d --build` (deploy/README.md).
set -euo pipefail

BASE_IMAGE=${CENTERLINE_BASE_IMAGE:-centerline-base:bookworm}
SUITE=${CENTERLINE_BASE_SUITE:-bookworm}
DOCKERD_LOG=${CENTERLINE_DOCKERD_LOG:-/var/log/centerline-dockerd.log}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu  # deploy/Dockerfile's default
ENV_FILE=$(cd "$(dirname "$0")/../.." && pwd)/.env

say() { echo "prepare: $*"; }
fail() { echo "prepare: error: $*" >&2; exit 1; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || fail "installing ${missing[*]} needs root (apt-get); run this as root or install them yourself"
    say "installing ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    [[ $(id -u) == 0 ]] || fail "no Docker daemon answers and starting one needs root; start dockerd (or the docker service)"
    say "starting dockerd (log: $DOCKERD_LOG)"
    nohup dockerd >"$DOCKERD_LOG" 2>&1 &
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && break
        kill -0 $! 2>/dev/null || fail "dockerd exited; its log: $DOCKERD_LOG"
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s; its log: $DOCKERD_LOG"
fi

# set_var NAME VALUE: NAME=VALUE in .env, replacing an earlier NAME= line.
set_var() {
    touch "$ENV_FILE"
    grep -v "^$1=" "$ENV_FILE" >"$ENV_FILE.new" || true
    echo "$1=$2" >>"$ENV_FILE.new"
    mv "$ENV_FILE.new" "$ENV_FILE"
    say "$ENV_FILE: $1=$2"
}

write_env() {
    set_var CENTERLINE_BASE_IMAGE "$BASE_IMAGE"
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$TORCH_CPU_INDEX/" 2>/dev/null; then
        set_var CENTERLINE_TORCH_INDEX_URL "$TORCH_CPU_INDEX"
    else
        set_var CENTERLINE_TORCH_INDEX_URL ""  # unreachable: torch from pip's index (with its CUDA libraries)
    fi
}

if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $BASE_IMAGE is there"
    write_env
    exit 0
fi

# The mirror apt uses here (deb822 sources first, then the one-line format).
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[[ -n $mirror ]] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[[ -n $mirror ]] || fail "no Debian mirror found in /etc/apt/sources.list*; set one there"

root=$(mktemp -d /tmp/centerline-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
say "building $BASE_IMAGE: debootstrap $SUITE from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$mirror" >/dev/null
chroot "$root" python3 -m venv /opt/venv
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$BASE_IMAGE" >/dev/null
say "built $BASE_IMAGE ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE") bytes)"
write_env
