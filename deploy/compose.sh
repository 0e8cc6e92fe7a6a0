#!/usr/bin/env bash
# Run the docker-compose federation (docker-compose.yml) end to end.
#
#   deploy/compose.sh up   STATE_DIR [--project dpfl] [--image dpfl:0.1.0] [--insecure]
#                                    [--control-port 9093] [--fleet-port 9092]
#   deploy/compose.sh run  STATE_DIR [flwr run options...]   # e.g. --run-config "num-rounds=2"
#   deploy/compose.sh down STATE_DIR
#
# up: certificates and SuperNode keys (deploy/certs.sh, SANs DNS:superlink and 127.0.0.1),
#     the SuperLink container, registration of each SuperNode's public key through the
#     Control API (`flwr supernode register`), then the ServerApp SuperExec and the SuperNodes.
#     --insecure (prints a warning) adds deploy/compose.insecure.yml: no TLS, no auth.
# run: `flwr run` of this repository's app against the SuperLink's published Control API;
#     the run directory lands in STATE_DIR/runs/ (mounted into the ServerApp SuperExec).
# down: `docker-compose down -v` (containers, network, the SuperLink's state volume).
# The image must exist (deploy/image.sh); DOCKER_HOST is honoured.
set -euo pipefail
cmd=${1:?usage: deploy/compose.sh up|run|down STATE_DIR ...}
state=${2:?STATE_DIR missing}
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_bin=${DPFL_VENV_BIN:-$repo/.venv/bin}
export PATH="$venv_bin:$PATH" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
  FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PYTHONWARNINGS=ignore

compose() {  # docker-compose with this federation's project, files and environment
  local files=(-f "$repo/docker-compose.yml")
  [ "$(cat "$state/insecure")" = 1 ] && files+=(-f "$repo/deploy/compose.insecure.yml")
  docker-compose --project-directory "$repo" --env-file "$state/compose.env" \
    -p "$(cat "$state/project")" "${files[@]}" "$@"
}

wait_port() {  # wait_port PORT: until the published port accepts connections (60 s)
  for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on 127.0.0.1:$1" >&2
  return 1
}

case "$cmd" in
up)
  project=dpfl image=dpfl:0.1.0 insecure=0 control=9093 fleet=9092
  while [ $# -gt 0 ]; do
    case "$1" in
      --project) project=$2; shift 2 ;;
      --image) image=$2; shift 2 ;;
      --insecure) insecure=1; shift ;;
      --control-port) control=$2; shift 2 ;;
      --fleet-port) fleet=$2; shift 2 ;;
      *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
  done
  mkdir -p "$state/runs" "$state/flwr-home"
  state=$(cd "$state" && pwd)
  echo "$project" > "$state/project"
  echo "$insecure" > "$state/insecure"
  if [ "$insecure" = 1 ]; then
    echo "WARNING: --insecure: no TLS and no SuperNode authentication; anyone on the network" \
         "can read updates and join the federation" >&2
    mkdir -p "$state/certs"
    conn_tls="insecure = true"
  else
    "$repo/deploy/certs.sh" "$state/certs" --san DNS:superlink --nodes 2 >/dev/null
    conn_tls="root-certificates = \"$state/certs/ca.crt\""
  fi
  cat > "$state/compose.env" <<ENV
DPFL_IMAGE=$image
DPFL_CERTS=$state/certs
DPFL_RUNS=$state/runs
DPFL_CONTROL_PORT=$control
DPFL_FLEET_PORT=$fleet
ENV
  printf '[superlink]\ndefault = "compose"\n\n[superlink.compose]\naddress = "127.0.0.1:%s"\n%s\n' \
    "$control" "$conn_tls" > "$state/flwr-home/config.toml"
  compose up -d --no-build superlink
  wait_port "$control"
  if [ "$insecure" = 0 ]; then
    for i in 0 1; do
      for _ in $(seq 1 30); do  # the Control API may lag the port by a moment
        FLWR_HOME=$state/flwr-home flwr supernode register \
          "$state/certs/keys/supernode-$i.pub" compose >> "$state/register.log" 2>&1 && break
        sleep 1
      done
    done
  fi
  compose up -d --no-build
  echo "federation up: project $project, SuperLink Control API 127.0.0.1:$control; state in $state"
  ;;
run)
  state=$(cd "$state" && pwd)
  FLWR_HOME=$state/flwr-home flwr run "$repo" compose --stream "$@"
  ;;
logs)
  state=$(cd "$state" && pwd)
  compose logs --no-color "$@"
  ;;
down)
  [ -f "$state/project" ] || exit 0
  state=$(cd "$state" && pwd)
  compose down -v --remove-orphans --timeout 20
  echo "federation down"
  ;;
*)
  echo "unknown command $cmd (up|run|logs|down)" >&2
  exit 2
  ;;
esac
