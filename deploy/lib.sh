# Shared by the deploy scripts (sourced after they set $me): one-line errors and the Docker
# engine check. A user error is one line on stderr naming what is wrong, exit 2.

die() {  # die CODE MESSAGE: one line on stderr, exit CODE
  echo "$me: $2" >&2
  exit "$1"
}

engine=${DOCKER_HOST:-unix:///var/run/docker.sock}

require_engine() {  # a Docker engine answers at DOCKER_HOST (else the CLI's context/default)
  local err reason
  err=$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null) && return 0
  [ -n "${DOCKER_HOST:-}" ] \
    || engine=$(docker context inspect --format '{{.Endpoints.docker.Host}}' 2>/dev/null || echo "$engine")
  case "$err" in
    *"Cannot connect to the Docker daemon"*) reason="nothing answers there" ;;
    *) reason=${err##*$'\n'} ;;
  esac
  die 2 "no Docker engine at $engine ($reason); start one (as root: 'dockerd &') or set DOCKER_HOST to a running engine's socket"
}
