#!/usr/bin/env bash
# A multi-host dpfl federation on one machine: Linux network namespaces as hosts.
#
#   deploy/netns.sh up   STATE_DIR [--nodes N] [--prefix dpfl] [--insecure] [--start-window S]
#                        [--own-nodes I,J] [--cold-clientapps]
#   deploy/netns.sh run  STATE_DIR [flwr run options...]     # e.g. --run-config "num-rounds=2"
#   deploy/netns.sh restart-superlink STATE_DIR               # stop and start it again
#   deploy/netns.sh node-stop  STATE_DIR I                     # SuperNode I leaves
#   deploy/netns.sh node-start STATE_DIR I [--superlink H:P] [--start-window S]  # ... (re)joins
#                              [--cold-clientapps]
#   deploy/netns.sh down STATE_DIR
#
# up: a bridge in namespace <prefix>-hub joins host namespaces by veth pairs on 10.77.0.0/24:
#     <prefix>-link (10.77.0.1) runs flower-superlink with TLS and SuperNode authentication
#     (certificates and keys from deploy/certs.sh), <prefix>-n<i> (10.77.0.<i+2>) each run a
#     flower-supernode with partition-id i that dials the SuperLink's gRPC Fleet API over
#     TLS, authenticated by its registered EC key. --insecure (prints a warning) drops TLS/auth.
#     The SuperNodes run as `python -m dpfl.runtime.supernode --warm-clientapps`: each node
#     forks its ClientApps from a process that has imported torch, Opacus and Flower once
#     (dpfl/runtime/warm_clientapps.py); --cold-clientapps runs Flower's flower-supernode
#     instead, which starts a new interpreter per instruction.
#     --start-window S: the SuperNodes also get `--clientapp-start-window S` (a ClientApp
#     process may take S seconds to start instead of Flower's fixed 30).
#     --own-nodes I,J (TLS only): supernode-I's key is registered and mapped like the others,
#     and its namespace made, but no SuperNode is started there: the caller runs its own node
#     with certs/keys/supernode-I in <prefix>-n<I> (e.g. the hostile node of
#     tests/e2e/test_hostile_nodes.py) and writes its PID to STATE_DIR/extra-<name>.pid.
#     Only the Fleet API (10.77.0.1:9092) is on the network: the Control API (submit runs,
#     register keys, list/stop runs) and the Runtime API, which Flower 1.39 serves together
#     over HTTP on --host/--port without account authentication, listen on 127.0.0.1:9093 of
#     the SuperLink's namespace, where the operator's `flwr` (connection "netns") runs.
# run: `flwr run` of this repository's app from inside the SuperLink's namespace, with
#     node-partitions (STATE_DIR/node-partitions: "<node-id>:<i>,...", the node ids Flower
#     fixed when `up` registered supernode-i's key): replies are charged by sender.
# restart-superlink: stops the SuperLink (and what it started) by PID and starts it again on
#     the same database (registered keys survive); SuperNodes reconnect on their own.
# node-stop: stops SuperNode I (and its ClientApps) by PID; its namespace and key stay.
# node-start: starts SuperNode I again with its registered key (so the same node id and
#     partition); --superlink makes it dial another address than 10.77.0.1:9092, e.g. a
#     fault-injecting relay on 127.0.0.1 in its own namespace (the SuperLink's certificate
#     names 127.0.0.1 too).
# Every SuperNode keeps its own durable privacy history in STATE_DIR/node-<i>-privacy
# (node-config privacy-dir, dpfl.client.node_history): a release lost in a SuperLink restart
# stays counted.
# down: stops every process it started (by PID, with their descendants) and those of
#     STATE_DIR/extra-*.pid, deletes the namespaces (and so the veths and the bridge).
# Traffic stays inside these namespaces. Needs root, iproute2, openssl, ssh-keygen and the
# venv's flower-superlink/flower-supernode/flwr (DPFL_VENV_BIN, default REPO/.venv/bin).
# Arguments and prerequisites are checked before anything is written: a problem is one line
# on stderr naming it, exit 2. If `up` fails after that, it takes down what it had made.
set -euo pipefail
me=deploy/netns.sh
usage="usage: $me up|run|restart-superlink|node-stop|node-start|down STATE_DIR [options]"
. "$(dirname "$0")/lib.sh"  # die, require_engine
cmd=${1:-}
case "$cmd" in
  up|run|restart-superlink|node-stop|node-start|down) ;;
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
link_ip=10.77.0.1
control=127.0.0.1:9093  # Control + Runtime HTTP API: the operator's, on the SuperLink's host only
# Flower's internal switch for a second, gRPC Control API (on --control-api-address,
# 0.0.0.0:9093 by default): never on here
unset FLWR_INTERNAL_GRPC_CONTROL_API

descendants() {  # all processes below $1
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

stop_tree() {  # SIGTERM a process and all its descendants, SIGKILL what is left
  local pid=$1 all p
  all="$pid $(descendants "$pid" | tr '\n' ' ')"
  for p in $all; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    local alive=0
    for p in $all; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.2
  done
  for p in $all; do kill -KILL "$p" 2>/dev/null || true; done
}

start_in_ns() {  # start_in_ns NS NAME COMMAND...   (background, PID recorded)
  local ns=$1 name=$2
  shift 2
  ip netns exec "$ns" setsid "$@" > "$state/$name.log" 2>&1 &
  echo $! > "$state/$name.pid"
}

start_superlink() {  # start_superlink STATE_DIR: from the options saved by `up`
  local prefix tls_link=()
  prefix=$(cat "$1/prefix")
  if [ "$(cat "$1/insecure")" = 1 ]; then
    tls_link=(--insecure)
  else
    tls_link=(--ssl-ca-certfile "$1/certs/ca.crt" --ssl-certfile "$1/certs/superlink.crt"
              --ssl-keyfile "$1/certs/superlink.key" --enable-supernode-auth)
  fi
  # dpfl.runtime.superlink = flower-superlink whose SQLite connections wait 60 s for a lock
  # (Flower's 5 s fails Fleet calls with "database is locked" at 20 SuperNodes on a busy host)
  FLWR_HOME=$1/superlink-home start_in_ns "$prefix-link" superlink \
    python -m dpfl.runtime.superlink --sqlite-busy-timeout 60 \
    "${tls_link[@]}" --fleet-api-address "$link_ip:9092" \
    --host "${control%:*}" --port "${control##*:}" --database "$1/superlink.db" \
    --disable-runtime-dependency-installation
  wait_port "$prefix-link" "$link_ip" 9092
  wait_port "$prefix-link" "${control%:*}" "${control##*:}"
}

start_supernode() {  # start_supernode STATE_DIR I SUPERLINK [WINDOW] [COLD]: SuperNode I, its own key
  local prefix nodes tls_node=(--insecure)
  prefix=$(cat "$1/prefix")
  nodes=$(cat "$1/nodes")
  if [ "$(cat "$1/insecure")" = 0 ]; then
    tls_node=(--root-certificates "$1/certs/ca.crt"
              --auth-supernode-private-key "$1/certs/keys/supernode-$2")
  fi
  local window=${4:-$(cat "$1/start-window" 2>/dev/null || true)}
  local options=() launcher=(flower-supernode)
  [ -e "$1/cold-clientapps" ] || [ -n "${5:-}" ] || options+=(--warm-clientapps)
  [ -z "$window" ] || options+=(--clientapp-start-window "$window")
  [ ${#options[@]} = 0 ] || launcher=(python -m dpfl.runtime.supernode "${options[@]}")
  [ ! -e "$1/supernode-$2.log" ] || mv "$1/supernode-$2.log" "$1/supernode-$2.log.$(date +%s%N)"
  FLWR_HOME=$1/node-$2-home start_in_ns "$prefix-n$2" "supernode-$2" \
    "${launcher[@]}" "${tls_node[@]}" --superlink "$3" --port 9094 \
    --node-config "partition-id=$2 num-partitions=$nodes privacy-dir=\"$1/node-$2-privacy\"" \
    --max-retries 20 --max-wait-time 120
}

wait_port() {  # wait_port NS IP PORT
  for _ in $(seq 1 150); do
    ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on $2:$3 in $1" >&2
  return 1
}

namespaces() {  # namespaces PREFIX: the names of this federation's namespaces
  ip netns list | awk '{print $1}' | grep "^$1-" || true
}

teardown() {  # teardown STATE PREFIX: stop its processes (by PID), delete its namespaces
  local f ns
  for f in "$1"/supernode-*.pid "$1"/extra-*.pid "$1"/superlink.pid; do
    [ -e "$f" ] || continue
    stop_tree "$(cat "$f")"
    rm -f "$f"
  done
  for ns in $(namespaces "$2"); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns delete "$ns"
  done
}

# -- checks: nothing is written before these pass --------------------------------------------

require_root() {  # every command creates, enters or deletes network namespaces
  [ "$(id -u)" = 0 ] || die 2 "needs root: '$cmd' runs 'ip netns' (network namespaces and veth links are root-only); run it with sudo"
}

require_tools() {  # require_tools TOOL...: each on PATH (the venv's bin/ first)
  local tool hint
  for tool in "$@"; do
    command -v "$tool" > /dev/null && continue
    case "$tool" in
      ip) hint="apt-get install iproute2" ;;
      setsid) hint="apt-get install util-linux" ;;
      ps) hint="apt-get install procps" ;;
      openssl|ssh-keygen) hint="apt-get install openssl openssh-client, or --insecure" ;;
      flower-*|flwr) hint="not in $venv_bin either: make the venv (make install) or set DPFL_VENV_BIN to the bin/ of one with dpfl" ;;
      *) hint="install it" ;;
    esac
    die 2 "'$tool' not found on PATH ($hint)"
  done
  if [[ " $* " == *" ip "* ]] && ! err=$(ip netns list 2>&1 >/dev/null); then
    die 2 "'ip netns list' fails here (${err:-no message}); this needs Linux network namespaces"
  fi
}

check_window() {  # check_window S: prints S if it is whole seconds 30..3600, else exit 2
  [[ $1 =~ ^[1-9][0-9]{1,3}$ ]] && [ "$1" -ge 30 ] && [ "$1" -le 3600 ] \
    || die 2 "--start-window '$1': expected whole seconds 30..3600 (Flower's own window is 30)"
  echo "$1"
}

check_prefix() {  # the namespace/interface prefix: interface names are at most 15 bytes
  [[ $1 =~ ^[a-z][a-z0-9]{0,9}$ ]] \
    || die 2 "--prefix '$1': expected 1-10 lowercase letters or digits, starting with a letter"
}

load_state() {  # load_state: STATE_DIR of an `up` (absolute), its prefix; else exit 2
  [ -d "$state" ] || die 2 "STATE_DIR '$state': no such directory (the folder of a '$me up')"
  [ -f "$state/prefix" ] \
    || die 2 "STATE_DIR '$state': not a netns federation's state (no prefix file; '$me up $state' makes one)"
  state=$(cd "$state" && pwd)
  prefix=$(cat "$state/prefix")
  [[ $prefix =~ ^[a-z][a-z0-9]{0,9}$ ]] || die 2 "'$state/prefix' is damaged ('$prefix')"
}

require_up() {  # the federation's SuperLink namespace exists
  ip netns list | awk '{print $1}' | grep -qx "$prefix-link" \
    || die 2 "the federation of '$state' is not up (no namespace $prefix-link); '$me up $state' first"
}

on_up_exit() {  # EXIT trap of `up`: a failure after the checks takes down what was made
  local rc=$?
  [ "$rc" = 0 ] && return 0
  teardown "$state" "$prefix" > /dev/null 2>&1 || true
  echo "$me: up failed (exit $rc); removed its namespaces and processes (logs in $state)" >&2
  exit 1  # a failure after the checks is not a usage error, whatever the failing tool returned
}

case "$cmd" in
up)
  nodes=2 prefix=dpfl insecure=0 window="" own="" cold=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes|--prefix|--start-window|--own-nodes) [ $# -ge 2 ] || die 2 "$1 needs a value" ;;
    esac
    case "$1" in
      --nodes) nodes=$2; shift 2 ;;
      --prefix) prefix=$2; shift 2 ;;
      --own-nodes) own=$2; shift 2 ;;
      --insecure) insecure=1; shift ;;
      --cold-clientapps) cold=1; shift ;;
      --start-window) window=$(check_window "$2"); shift 2 ;;
      *) die 2 "unknown argument '$1' (up STATE_DIR [--nodes N] [--prefix P] [--insecure] [--start-window S] [--own-nodes I,J] [--cold-clientapps])" ;;
    esac
  done
  [[ $nodes =~ ^[1-9][0-9]{0,2}$ ]] && [ "$nodes" -le 253 ] \
    || die 2 "--nodes '$nodes': expected a whole number 1..253 (one 10.77.0.0/24 address each)"
  if [ -n "$own" ]; then
    [[ $own =~ ^[0-9]{1,3}(,[0-9]{1,3})*$ ]] \
      || die 2 "--own-nodes '$own': expected node indices separated by commas (e.g. 2 or 1,2)"
    for i in ${own//,/ }; do
      [ "$i" -lt "$nodes" ] || die 2 "--own-nodes: node $i does not exist (--nodes $nodes: 0..$((nodes - 1)))"
    done
    [ "$insecure" = 0 ] || die 2 "--own-nodes needs TLS and SuperNode auth (not --insecure): an own node runs with a registered key"
  fi
  check_prefix "$prefix"
  if [ -e "$state" ] && [ ! -d "$state" ]; then die 2 "STATE_DIR '$state' exists and is not a directory"; fi
  require_root
  require_tools ip setsid ps python flower-superlink flower-supernode
  [ "$insecure" = 1 ] || require_tools flwr openssl ssh-keygen
  taken=$(namespaces "$prefix" | tr '\n' ' ')
  [ -z "$taken" ] || die 2 "namespaces of prefix '$prefix' already exist (${taken% }); '$me down' their STATE_DIR first, or pick another --prefix"
  mkdir -p "$state"
  state=$(cd "$state" && pwd)
  trap on_up_exit EXIT
  echo "$prefix" > "$state/prefix"
  echo "$nodes" > "$state/nodes"
  echo "$insecure" > "$state/insecure"
  [ -z "$window" ] || echo "$window" > "$state/start-window"
  [ "$cold" = 0 ] || : > "$state/cold-clientapps"
  hub=$prefix-hub
  ip netns add "$hub"
  ip -n "$hub" link set lo up
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  hosts=("link")
  for ((i = 0; i < nodes; i++)); do hosts+=("n$i"); done
  idx=1
  for h in "${hosts[@]}"; do
    ns=$prefix-$h
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "${prefix}${h}a" type veth peer name "${prefix}${h}b"
    ip link set "${prefix}${h}a" netns "$ns"
    ip link set "${prefix}${h}b" netns "$hub"
    ip -n "$ns" link set "${prefix}${h}a" name eth0
    ip -n "$ns" addr add "10.77.0.$idx/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$hub" link set "${prefix}${h}b" master br0
    ip -n "$hub" link set "${prefix}${h}b" up
    idx=$((idx + 1))
  done
  conn_tls="insecure = true"
  if [ "$insecure" = 1 ]; then
    echo "WARNING: --insecure: no TLS and no SuperNode authentication; anyone on the network" \
         "can read updates and join the federation" >&2
  else
    "$repo/deploy/certs.sh" "$state/certs" --san "IP:$link_ip" --nodes "$nodes" >/dev/null
    conn_tls="root-certificates = \"$state/certs/ca.crt\""
  fi
  mkdir -p "$state/flwr-home"
  printf '[superlink]\ndefault = "netns"\n\n[superlink.netns]\naddress = "%s"\n%s\n' \
    "$control" "$conn_tls" > "$state/flwr-home/config.toml"
  start_superlink "$state"
  node_map=""
  for ((i = 0; i < nodes; i++)); do
    if [ "$insecure" = 0 ]; then
      out=$(FLWR_HOME=$state/flwr-home ip netns exec "$prefix-link" \
        flwr supernode register "$state/certs/keys/supernode-$i.pub" netns 2>&1) \
        || { printf '%s\n' "$out" >> "$state/register.log"; die 1 "registering supernode-$i failed (see $state/register.log)"; }
      printf '%s\n' "$out" >> "$state/register.log"
      # the node id Flower fixed for this key: the partition binding (node-partitions)
      node_id=$(printf '%s\n' "$out" | sed -n 's/.*SuperNode \([0-9][0-9]*\) registered.*/\1/p' | head -n 1)
      [ -n "$node_id" ] || die 1 "registering supernode-$i printed no node id (see $state/register.log)"
      node_map+="${node_map:+,}$node_id:$i"
    fi
    [[ ",$own," == *",$i,"* ]] && continue  # the caller runs this node (--own-nodes)
    start_supernode "$state" "$i" "$link_ip:9092"
  done
  # the operator's map of registered keys to partitions (none without authentication)
  printf '%s\n' "$node_map" > "$state/node-partitions"
  trap - EXIT
  echo "federation up: SuperLink $link_ip (namespace $prefix-link), $nodes SuperNodes; state in $state"
  ;;
run)
  require_root
  require_tools ip flwr
  load_state
  require_up
  # every reply is charged to the partition of the key that sent it (a later
  # --run-config may override node-partitions; flwr merges them in order)
  map_arg=()
  if [ -s "$state/node-partitions" ] && [ -n "$(cat "$state/node-partitions")" ]; then
    map_arg=(--run-config "node-partitions='$(cat "$state/node-partitions")'")
  fi
  # the FAB's files only: `flwr run REPO` would first walk every file of the checkout (.venv)
  app=$(python -m dpfl.runtime.fab "$repo" "$state/app") \
    || die 1 "could not stage the app from $repo"
  # flwr run exits 0 whether or not the ServerApp finished: the run's status says (a
  # ServerApp that stopped early is finished:failed; dpfl.runstatus prints one line why)
  stream=$state/run-stream.log
  set +e
  FLWR_HOME=$state/flwr-home DPFL_OUTPUT_ROOT=$state ip netns exec "$prefix-link" \
    flwr run "$app" netns --stream "${map_arg[@]}" "$@" 2>&1 | tee "$stream"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || die "$rc" "flwr run exited $rc (see its output above)"
  run_id=$(python -c 'import sys; from dpfl.runstatus import run_id_of; print(run_id_of(open(sys.argv[1]).read()) or "")' "$stream")
  [ -n "$run_id" ] || die 1 "flwr run started no run (see its output above)"
  FLWR_HOME=$state/flwr-home ip netns exec "$prefix-link" \
    flwr ls netns --run-id "$run_id" --format json >"$state/run-status.json" 2>/dev/null || true
  python -m dpfl.runstatus "$stream" "$state/run-status.json"
  ;;
restart-superlink)
  [ $# = 0 ] || die 2 "unknown argument '$1' (restart-superlink STATE_DIR)"
  require_root
  require_tools ip setsid ps flower-superlink
  load_state
  require_up
  [ -f "$state/superlink.pid" ] || die 2 "'$state/superlink.pid' missing: no SuperLink of this federation to restart"
  stop_tree "$(cat "$state/superlink.pid")"
  mv "$state/superlink.log" "$state/superlink.log.$(date +%s)"
  start_superlink "$state"
  echo "SuperLink restarted"
  ;;
node-stop|node-start)
  [ $# -ge 1 ] || die 2 "node index missing ($cmd STATE_DIR I)"
  node=$1
  shift
  superlink=$link_ip:9092 window="" cold=""
  while [ $# -gt 0 ]; do
    case "$cmd $1" in
      "node-start --superlink")
        [ $# -ge 2 ] || die 2 "--superlink needs a value (HOST:PORT)"
        [[ $2 =~ ^[A-Za-z0-9.-]+:[0-9]{1,5}$ ]] || die 2 "--superlink '$2': expected HOST:PORT"
        superlink=$2; shift 2 ;;
      "node-start --start-window")
        [ $# -ge 2 ] || die 2 "--start-window needs a value (seconds)"
        window=$(check_window "$2"); shift 2 ;;
      "node-start --cold-clientapps") cold=1; shift ;;
      *) die 2 "unknown argument '$1' (node-stop STATE_DIR I; node-start STATE_DIR I [--superlink HOST:PORT] [--start-window S] [--cold-clientapps])" ;;
    esac
  done
  require_root
  require_tools ip setsid ps flower-supernode
  load_state
  require_up
  [[ $node =~ ^(0|[1-9][0-9]{0,2})$ ]] && [ "$node" -lt "$(cat "$state/nodes")" ] \
    || die 2 "node index '$node': expected 0..$(( $(cat "$state/nodes") - 1 ))"
  pidfile=$state/supernode-$node.pid
  if [ "$cmd" = node-stop ]; then
    [ -f "$pidfile" ] || die 2 "SuperNode $node is not running (no $pidfile)"
    stop_tree "$(cat "$pidfile")"
    rm -f "$pidfile"
    echo "SuperNode $node stopped"
  else
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      die 2 "SuperNode $node is running (PID $(cat "$pidfile")); node-stop it first"
    fi
    start_supernode "$state" "$node" "$superlink" "$window" "$cold"
    echo "SuperNode $node started (dials $superlink)"
  fi
  ;;
down)
  [ $# = 0 ] || die 2 "unknown argument '$1' (down STATE_DIR)"
  require_root
  require_tools ip ps
  load_state
  teardown "$state" "$prefix"
  echo "federation down"
  ;;
esac
