#!/usr/bin/env bash
# Run the docker-compose federation (docker-compose.yml) end to end.
#
#   deploy/compose.sh up   STATE_DIR [--project dpfl] [--image dpfl:0.1.0] [--insecure]
#                                    [--fleet-port 9092]
#   deploy/compose.sh run  STATE_DIR [flwr run options...]   # e.g. --run-config "num-rounds=2"
#   deploy/compose.sh logs STATE_DIR [docker-compose logs options...]
#   deploy/compose.sh down STATE_DIR
#
# up: certificates and SuperNode keys (deploy/certs.sh, SANs DNS:superlink and 127.0.0.1),
#     the SuperLink container, registration of each SuperNode's public key through the
#     Control API (`flwr supernode register` in the `operator` container), then the ServerApp
#     SuperExec and the SuperNodes. Only the Fleet API is published (127.0.0.1:--fleet-port):
#     the Control API listens on 127.0.0.1:9093 inside the SuperLink's network namespace,
#     shared by the ServerApp SuperExec and the one-off operator containers only.
#     --insecure (prints a warning) adds deploy/compose.insecure.yml: no TLS, no auth.
# run: `flwr run` of this repository's app (mounted read-only at /app) from a one-off
#     `operator` container in the SuperLink's network namespace; the run directory lands in
#     STATE_DIR/runs/ (mounted into the ServerApp SuperExec).
# down: `docker-compose down -v` (containers, network, the SuperLink's state volume).
# The image must exist (deploy/image.sh); DOCKER_HOST is honoured.
# Arguments and STATE_DIR, then tools (docker-compose, docker), the engine and the image are
# checked, in that order, before anything is written: a problem is one line on stderr naming
# it, exit 2 (so a bad argument is named even where docker-compose is not installed). If `up` fails
# after that, it takes down the containers it had started.
set -euo pipefail
me=deploy/compose.sh
usage="usage: $me up|run|logs|down STATE_DIR [options]"
. "$(dirname "$0")/lib.sh"  # die, require_engine
cmd=${1:-}
case "$cmd" in
  up|run|logs|down) ;;
  "") die 2 "command missing ($usage)" ;;
  *) die 2 "unknown command '$cmd' ($usage)" ;;
esac
[ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != -* ]] || die 2 "STATE_DIR missing ($usage)"
state=$2
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

operator() {  # operator FLWR_ARGS...: `flwr` in a one-off container on the SuperLink's loopback
  local tty=()
  [ -t 0 ] && [ -t 1 ] || tty=(-T)
  compose run --rm "${tty[@]}" operator "$@"
}

wait_superlink() {  # until the SuperLink's HTTP API (Control + Runtime) is up (60 s)
  for _ in $(seq 1 120); do
    [[ $(compose logs --no-color superlink 2>/dev/null) == *"Application startup complete"* ]] && return 0
    sleep 0.5
  done
  echo "the SuperLink's Control API did not start (see: $me logs $state)" >&2
  return 1
}

# -- checks: nothing is written before these pass --------------------------------------------

require_tools() {  # require_tools TOOL...: each on PATH (the venv's bin/ first)
  local tool hint
  for tool in "$@"; do
    command -v "$tool" > /dev/null && continue
    case "$tool" in
      docker-compose) hint="apt-get install docker-compose" ;;
      docker) hint="apt-get install docker.io" ;;
      *) hint="apt-get install openssl openssh-client, or --insecure" ;;
    esac
    die 2 "'$tool' not found on PATH ($hint)"
  done
}


require_image() {  # require_image TAG: the image is in the engine (up never pulls or builds)
  docker image inspect "$1" > /dev/null 2>&1 \
    || die 2 "image '$1' is not in the Docker engine at $engine; build it: deploy/image.sh --tag $1"
}

require_port() {  # require_port OPTION VALUE
  [[ $2 =~ ^[1-9][0-9]{0,4}$ ]] && [ "$2" -le 65535 ] || die 2 "$1 '$2': expected a port 1..65535"
}

load_state() {  # load_state: STATE_DIR of an `up` (absolute); else exit 2
  [ -d "$state" ] || die 2 "STATE_DIR '$state': no such directory (the folder of a '$me up')"
  [ -f "$state/project" ] && [ -f "$state/compose.env" ] \
    || die 2 "STATE_DIR '$state': not a compose federation's state (no project/compose.env; '$me up $state' makes them)"
  state=$(cd "$state" && pwd)
}

on_up_exit() {  # EXIT trap of `up`: a failure after the checks takes down what was started
  local rc=$?
  [ "$rc" = 0 ] && return 0
  compose down -v --remove-orphans --timeout 20 > /dev/null 2>&1 || true
  echo "$me: up failed (exit $rc); took its containers down (logs in $state)" >&2
  exit 1
}

case "$cmd" in
up)
  project=dpfl image=dpfl:0.1.0 insecure=0 fleet=9092
  while [ $# -gt 0 ]; do
    case "$1" in
      --project|--image|--fleet-port) [ $# -ge 2 ] || die 2 "$1 needs a value" ;;
    esac
    case "$1" in
      --project) project=$2; shift 2 ;;
      --image) image=$2; shift 2 ;;
      --insecure) insecure=1; shift ;;
      --fleet-port) fleet=$2; shift 2 ;;
      --control-port) die 2 "--control-port: the Control API is not published any more (it accepts runs and SuperNode keys from anyone who reaches it); the operator runs flwr in the SuperLink's network namespace: '$me run', or 'docker-compose run --rm operator ARGS'" ;;
      *) die 2 "unknown argument '$1' (up STATE_DIR [--project P] [--image I] [--insecure] [--fleet-port N])" ;;
    esac
  done
  [[ $project =~ ^[a-z0-9][a-z0-9_-]*$ ]] \
    || die 2 "--project '$project': expected lowercase letters, digits, '-' and '_' (a compose project name)"
  [ -n "$image" ] || die 2 "--image is empty"
  require_port --fleet-port "$fleet"
  if [ -e "$state" ] && [ ! -d "$state" ]; then die 2 "STATE_DIR '$state' exists and is not a directory"; fi
  require_tools docker-compose docker
  [ "$insecure" = 1 ] || require_tools openssl ssh-keygen
  require_engine
  require_image "$image"
  mkdir -p "$state/runs"
  state=$(cd "$state" && pwd)
  echo "$project" > "$state/project"
  echo "$insecure" > "$state/insecure"
  if [ "$insecure" = 1 ]; then
    echo "WARNING: --insecure: no TLS and no SuperNode authentication; anyone on the network" \
         "can read updates and join the federation" >&2
    mkdir -p "$state/certs"
  else
    "$repo/deploy/certs.sh" "$state/certs" --san DNS:superlink --nodes 2 >/dev/null
  fi
  cat > "$state/compose.env" <<ENV
DPFL_IMAGE=$image
DPFL_CERTS=$state/certs
DPFL_RUNS=$state/runs
DPFL_APP=$repo
DPFL_FLEET_PORT=$fleet
ENV
  trap on_up_exit EXIT
  compose up -d --no-build superlink
  wait_superlink
  node_map=""
  if [ "$insecure" = 0 ]; then
    for i in 0 1; do
      registered=0
      for _ in $(seq 1 10); do  # the Control API may lag its log line by a moment
        if out=$(operator supernode register "/certs/keys/supernode-$i.pub" superlink 2>&1); then
          registered=1
        fi
        printf '%s\n' "$out" >> "$state/register.log"
        [ "$registered" = 1 ] && break
        sleep 1
      done
      [ "$registered" = 1 ] || die 1 "registering supernode-$i failed (see $state/register.log)"
      # the node id Flower fixed for this key: bound to partition i (node-partitions)
      node_id=$(printf '%s\n' "$out" | sed -n 's/.*SuperNode \([0-9][0-9]*\) registered.*/\1/p' | head -n 1)
      [ -n "$node_id" ] || die 1 "registering supernode-$i printed no node id (see $state/register.log)"
      node_map+="${node_map:+,}$node_id:$i"
    done
  fi
  printf '%s\n' "$node_map" > "$state/node-partitions"
  compose up -d --no-build
  trap - EXIT
  echo "federation up: project $project, Fleet API 127.0.0.1:$fleet, Control API on the SuperLink's loopback only; state in $state"
  ;;
run)
  load_state
  require_tools docker-compose docker
  require_engine
  map_arg=()   # replies charged by the sender's registered key (a later --run-config may override)
  if [ -s "$state/node-partitions" ] && [ -n "$(cat "$state/node-partitions")" ]; then
    map_arg=(--run-config "node-partitions='$(cat "$state/node-partitions")'")
  fi
  # flwr run exits 0 whether or not the ServerApp finished: the run's status says (a
  # ServerApp that stopped early is finished:failed), read like dpfl/runstatus.py does
  stream=$state/run-stream.log
  set +e
  operator run /app superlink --stream "${map_arg[@]}" "$@" 2>&1 | tee "$stream"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || die "$rc" "flwr run exited $rc (see its output above)"
  case " $* " in *" --help "*|*" -h "*) exit 0 ;; esac
  run_id=$(sed 's/\x1b\[[0-9;]*m//g' "$stream" | sed -n 's/.*Successfully started run \([0-9][0-9]*\).*/\1/p' | tail -1)
  [ -n "$run_id" ] || die 1 "flwr run started no run (see its output above)"
  status=$( { operator ls superlink --run-id "$run_id" --format json 2>/dev/null || true; } \
    | sed -n 's/.*"status": *"\([^"]*\)".*/\1/p' | tail -1)
  if [ "$status" != "finished:completed" ]; then
    reason=$(sed 's/\x1b\[[0-9;]*m//g' "$stream" | sed -n 's/.*ERROR *: *\(the run stopped after round .*\)/\1/p' | tail -1)
    [ -n "$reason" ] || reason=$(sed 's/\x1b\[[0-9;]*m//g' "$stream" | sed -n 's/.*ERROR *: *error: \(.*\)/\1/p' | tail -1)
    die 1 "run $run_id: the run did not finish (${status:-status unknown}): ${reason:-no reason in the log}"
  fi
  ;;
logs)
  load_state
  require_tools docker-compose
  compose logs --no-color "$@"
  ;;
down)
  [ $# = 0 ] || die 2 "unknown argument '$1' (down STATE_DIR)"
  load_state
  require_tools docker-compose docker
  require_engine
  compose down -v --remove-orphans --timeout 20
  echo "federation down"
  ;;
esac
