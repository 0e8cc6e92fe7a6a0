#!/usr/bin/env bash
# An ARM64 dpfl SuperNode, emulated by qemu-user, in a TLS + SuperNode-auth federation with an
# x86_64 SuperNode: the edge install (deploy/edge/install.sh) run for real on arm64, DP rounds.
#
#   deploy/edge/arm64-demo.sh [--cache DIR] [--out DIR] [--rounds N] [--train-subset N]
#                             [--threads N] [--torch SPEC]
#
# --cache DIR       the arm64 root filesystem lives in DIR/rootfs, built once and reused
#                   (default $DPFL_ARM64_ROOT, else /var/cache/dpfl-arm64); the run's state
#                   (certificates, logs, the run directory) in DIR/state, made afresh each run
# --out DIR         where the transcript (arm64-demo.log) and the run's rounds.jsonl,
#                   ledger.json, summary.json and config.json are copied (default DIR/state)
# --rounds N        DP rounds (default 3)
# --train-subset N  MNIST training examples split over the 2 partitions (default 4000)
# --threads N       torch threads of each SuperNode (default 2)
# --torch SPEC      the arm64 torch (default: install.sh's, on aarch64 torch<2.11, the last
#                   CPU-only aarch64 wheels on PyPI; later ones pull the CUDA toolkit, GBs)
#
# What it does, all of it visible below:
#  1. binfmt_misc: mounted if it is not, Debian's qemu-aarch64 handler enabled
#     (update-binfmts; flag F: the interpreter is opened at registration, so it works in a
#     chroot without copying qemu in);
#  2. DIR/rootfs: Debian bookworm arm64 (minbase + python3.11, venv, ca-certificates) by
#     `debootstrap --arch arm64 --foreign`, second stage under qemu (once, tens of minutes);
#  3. /proc, /dev, /sys mounted into it (unmounted at exit, whatever happens); the checkout
#     copied to /src/dpfl in it; deploy/edge/install.sh --no-service run in it: a venv in
#     /opt/dpfl with CPU torch (PyPI's aarch64 wheels are CPU-only) and dpfl[mnist] from the
#     checkout, /etc/dpfl with the CA, supernode-1's key, supernode.env and the rendered unit
#     (pip through the host's resolver and CA bundle; flwr, opacus, numpy, scipy, grpcio,
#     protobuf and dp-accounting pinned to the host venv's versions);
#  4. a network namespace (lo only; all federation traffic stays in it) with, from the host
#     venv, flower-superlink (TLS with a fresh CA from deploy/certs.sh, --enable-supernode-auth,
#     both keys registered) and an x86_64 flower-supernode (partition 0), and the arm64
#     SuperNode (partition 1): the unit's ExecStart with supernode.env as its environment,
#     in the chroot, as systemd would run it;
#  5. `flwr run` of the checkout: N DP-SGD rounds (Opacus), then per-round reply times of
#     each SuperNode, the round times and the privacy ledger's charge of client-1 (arm64).
# Stops every process it started (by PID, with descendants), deletes its namespace and
# unmounts what it mounted, also on failure. Needs root, debootstrap, qemu-user-static,
# binfmt-support, iproute2, openssl, ssh-keygen and the host venv (DPFL_VENV_BIN, default
# REPO/.venv/bin). Arguments and prerequisites are checked before anything is written: a
# problem is one line on stderr naming it, exit 2.
set -euo pipefail
me=deploy/edge/arm64-demo.sh
usage="usage: $me [--cache DIR] [--out DIR] [--rounds N] [--train-subset N] [--threads N] [--torch SPEC]"
. "$(dirname "$0")/../lib.sh"  # die
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv_bin=${DPFL_VENV_BIN:-$repo/.venv/bin}
command_line="$me $*"

cache=${DPFL_ARM64_ROOT:-/var/cache/dpfl-arm64} out="" rounds=3 subset=4000 threads=2 torch_spec=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cache|--out|--rounds|--train-subset|--threads|--torch)
      [ $# -ge 2 ] && [ -n "$2" ] || die 2 "$1 needs a value ($usage)" ;;
  esac
  case "$1" in
    --cache) cache=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --train-subset) subset=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --torch) torch_spec=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument '$1' ($usage)" ;;
  esac
done
[[ $cache == /* && $cache != *[[:space:]\|\'\"]* && $cache != / ]] \
  || die 2 "--cache '$cache': expected an absolute path without spaces or quotes (not /)"
[ -z "$out" ] || [[ $out != *[[:space:]]* ]] || die 2 "--out '$out': expected a path without spaces"
[[ $rounds =~ ^[1-9][0-9]{0,2}$ ]] || die 2 "--rounds '$rounds': expected a whole number 1..999"
[[ $subset =~ ^[1-9][0-9]{0,4}$ ]] && [ "$subset" -ge 100 ] && [ "$subset" -le 60000 ] \
  || die 2 "--train-subset '$subset': expected a whole number 100..60000 (MNIST has 60000)"
[[ $threads =~ ^[1-9][0-9]{0,2}$ ]] || die 2 "--threads '$threads': expected a whole number >= 1"
[ -z "$torch_spec" ] || [[ $torch_spec =~ ^torch([=\<\>~!]=?[0-9][0-9A-Za-z.+]*)?$ ]] \
  || die 2 "--torch '$torch_spec': expected torch, torch==<version> or torch<<version>"
if [ -e "$cache" ] && [ ! -d "$cache" ]; then die 2 "--cache '$cache' exists and is not a directory"; fi
if [ -n "$out" ] && [ -e "$out" ] && [ ! -d "$out" ]; then die 2 "--out '$out' exists and is not a directory"; fi

# -- prerequisites ------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die 2 "needs root: debootstrap, chroot, mounts and network namespaces are root-only; run it with sudo"
for tool in debootstrap chroot mount umount mountpoint findmnt ip setsid ps openssl ssh-keygen git tar update-binfmts; do
  command -v "$tool" > /dev/null && continue
  case "$tool" in
    debootstrap) hint="apt-get install debootstrap" ;;
    update-binfmts) hint="apt-get install binfmt-support" ;;
    ip) hint="apt-get install iproute2" ;;
    openssl|ssh-keygen) hint="apt-get install openssl openssh-client" ;;
    *) hint="install it" ;;
  esac
  die 2 "'$tool' not found on PATH ($hint)"
done
qemu=""
for q in /usr/libexec/qemu-binfmt/aarch64-binfmt-P /usr/bin/qemu-aarch64-static; do
  [ -x "$q" ] && { qemu=$q; break; }
done
[ -n "$qemu" ] || die 2 "no qemu aarch64 user-mode emulator (apt-get install qemu-user-static binfmt-support)"
for tool in flower-superlink flower-supernode flwr python; do
  [ -x "$venv_bin/$tool" ] \
    || die 2 "'$venv_bin/$tool' not found: make the venv (make install) or set DPFL_VENV_BIN to the bin/ of one with dpfl"
done
git -C "$repo" rev-parse --git-dir > /dev/null 2>&1 || die 2 "'$repo' is not a git checkout (the checkout is what the chroot installs)"
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
         | awk '$1=="URIs:"{print $2; exit} $1=="deb"{print ($2 ~ /^\[/ ? $3 : $2); exit}' || true)
[ -n "$mirror" ] || die 2 "no apt mirror found in /etc/apt/sources.list{,.d/} (debootstrap needs one)"
ns=dpflarm64
if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$ns"; then
  die 2 "network namespace '$ns' exists (another demo running, or a killed one: 'ip netns delete $ns')"
fi
err=$(ip netns list 2>&1 >/dev/null) || die 2 "'ip netns list' fails here (${err:-no message}); this needs Linux network namespaces"

# -- from here on, everything made is undone at exit --------------------------------------------
rootfs=$cache/rootfs
state=$cache/state
mkdir -p "$cache"
[ -d "$state" ] && ! findmnt -rn -o TARGET | grep -q "^$state" && rm -rf "$state"
mkdir -p "$state"
out=${out:-$state}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/arm64-demo.log
: > "$log"
exec > >(tee -a "$log") 2>&1
tee_pid=$!
mounted=()        # mount points, in mount order
pidfiles=()       # processes started, in start order
binfmt_mounted=0
ns_made=0

say() { printf '\n== %s  (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

descendants() {  # all processes below $1
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

stop_tree() {  # SIGTERM a process and its descendants, SIGKILL what is left after 30 s
  local pid=$1 all p alive
  all="$pid $(descendants "$pid" | tr '\n' ' ')"
  for p in $all; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 150); do
    alive=0
    for p in $all; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.2
  done
  for p in $all; do kill -KILL "$p" 2>/dev/null || true; done
}

cleanup() {
  local rc=$? i f
  trap - EXIT INT TERM
  for ((i = ${#pidfiles[@]} - 1; i >= 0; i--)); do
    f=${pidfiles[$i]}
    [ -f "$f" ] && stop_tree "$(cat "$f")" && rm -f "$f"
  done
  if [ "$ns_made" = 1 ]; then
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
  fi
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[$i]}" 2>/dev/null || umount -R -l "${mounted[$i]}" 2>/dev/null || true
  done
  [ "$binfmt_mounted" = 0 ] || umount /proc/sys/fs/binfmt_misc 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    echo "$me: failed (exit $rc); stopped what it started, unmounted what it mounted (logs in $state)" >&2
  fi
  exec >&- 2>&-
  for _ in $(seq 1 20); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
  [ "$rc" = 0 ] || exit 1
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_bg() {  # start_bg NAME COMMAND...: in the namespace, own session, PID recorded
  local name=$1
  shift
  ip netns exec "$ns" setsid "$@" > "$state/$name.log" 2>&1 &
  echo $! > "$state/$name.pid"
  pidfiles+=("$state/$name.pid")
}

step() {  # step NAME LOG COMMAND...: a long step in the background, waited for (so that a
  # signal stops the script at once: cleanup then stops the step by PID); its status returned
  local name=$1 out=$2 pid rc=0
  shift 2
  "$@" > "$out" 2>&1 &
  pid=$!
  echo "$pid" > "$state/$name.pid"
  pidfiles+=("$state/$name.pid")
  wait "$pid" || rc=$?
  rm -f "$state/$name.pid"
  return "$rc"
}

wait_port() {  # wait_port PORT: something listens on 127.0.0.1:PORT in the namespace
  for _ in $(seq 1 300); do
    ip netns exec "$ns" bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on 127.0.0.1:$1 in namespace $ns" >&2
  return 1
}

in_chroot() {  # in_chroot COMMAND...: niced, a clean environment (no host PIP_*/PATH), as root
  env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/dpfl-host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
    PIP_CONSTRAINT=/tmp/dpfl-install/constraints.txt nice -n 19 /usr/sbin/chroot "$rootfs" "$@"
}

echo "\$ $command_line"
echo "host: $(uname -srm); $(nproc) cores; repo $repo at $(git -C "$repo" rev-parse --short HEAD)"

# -- 1. binfmt ---------------------------------------------------------------------------------
say "1. binfmt_misc and qemu-aarch64"
if ! mountpoint -q /proc/sys/fs/binfmt_misc; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  binfmt_mounted=1
fi
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 \
  || { echo "$me: the qemu-aarch64 binfmt handler is registered but disabled" >&2; exit 1; }
sed -n '1,3p' /proc/sys/fs/binfmt_misc/qemu-aarch64

# -- 2. the arm64 root filesystem ----------------------------------------------------------------
say "2. arm64 root filesystem $rootfs"
# stale mounts of a killed earlier run (ours: under our rootfs) go first
{ findmnt -rn -o TARGET | grep "^$rootfs/" || true; } | sort -r | while read -r m; do umount -R -l "$m" || true; done
if [ -f "$rootfs/.dpfl-rootfs-complete" ]; then
  echo "reused (built $(cat "$rootfs/.dpfl-rootfs-complete"))"
else
  rm -rf "$cache/rootfs.tmp"
  echo "debootstrap --arch arm64 --foreign bookworm from the apt mirror of /etc/apt (first stage)"
  step debootstrap "$cache/debootstrap.log" nice -n 19 debootstrap --arch arm64 --foreign \
    --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
    "$cache/rootfs.tmp" "$mirror" \
    || { echo "$me: debootstrap failed: $(tail -1 "$cache/debootstrap.log")" >&2; exit 1; }
  echo "second stage under qemu (slow)"
  step debootstrap2 "$cache/debootstrap2.log" nice -n 19 chroot "$cache/rootfs.tmp" \
    /debootstrap/debootstrap --second-stage \
    || { echo "$me: debootstrap --second-stage failed: $(tail -1 "$cache/debootstrap2.log")" >&2; exit 1; }
  rm -rf "$cache/rootfs.tmp"/var/cache/apt/archives/*.deb
  date -u +%Y-%m-%dT%H:%M:%SZ > "$cache/rootfs.tmp/.dpfl-rootfs-complete"
  mv "$cache/rootfs.tmp" "$rootfs"
fi
echo "chroot uname -m: $(chroot "$rootfs" uname -m)"
echo "chroot python3: $(chroot "$rootfs" python3 -c 'import platform, sys; print(sys.version.split()[0], platform.machine())')"

# -- 3. mounts, the checkout, install.sh -----------------------------------------------------------
say "3. deploy/edge/install.sh --no-service inside the arm64 chroot"
mount -t proc proc "$rootfs/proc"; mounted+=("$rootfs/proc")
mount --rbind /dev "$rootfs/dev"; mount --make-rslave "$rootfs/dev"; mounted+=("$rootfs/dev")
mount --rbind /sys "$rootfs/sys"; mount --make-rslave "$rootfs/sys"; mounted+=("$rootfs/sys")
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp /etc/hosts "$rootfs/etc/hosts"
cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$rootfs/etc/dpfl-host-ca.crt"
rm -rf "$rootfs/src/dpfl" "$rootfs/tmp/dpfl-install"
mkdir -p "$rootfs/src/dpfl" "$rootfs/tmp/dpfl-install"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
  | (cd "$repo" && tar --null -T - -cf - 2>/dev/null) | tar -xf - -C "$rootfs/src/dpfl"
echo "checkout copied to /src/dpfl ($(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo ', with uncommitted changes'))"
"$venv_bin/python" -m pip freeze 2>/dev/null \
  | grep -iE '^(flwr|opacus|numpy|scipy|grpcio|protobuf|dp-accounting)==' \
  > "$rootfs/tmp/dpfl-install/constraints.txt" || true
echo "pinned to the host venv's versions: $(tr '\n' ' ' < "$rootfs/tmp/dpfl-install/constraints.txt")"
"$repo/deploy/certs.sh" "$state/certs" --nodes 2 > /dev/null
cp "$state/certs/ca.crt" "$state/certs/keys/supernode-1" "$rootfs/tmp/dpfl-install/"
install_cmd=(bash /src/dpfl/deploy/edge/install.sh --superlink 127.0.0.1:9092
  --ca /tmp/dpfl-install/ca.crt --key /tmp/dpfl-install/supernode-1 --partition-id 1
  --num-partitions 2 --threads "$threads" ${torch_spec:+--torch "$torch_spec"} --no-service)
echo "chroot \$ ${install_cmd[*]}"
t0=$(date +%s)
step install "$state/install.log" in_chroot "${install_cmd[@]}" \
  || { echo "$me: install.sh in the chroot failed: $(tail -1 "$state/install.log")" >&2; exit 1; }
rm -rf "$rootfs/tmp/dpfl-install"
tail -1 "$state/install.log"
echo "install.sh took $(( $(date +%s) - t0 )) s"
in_chroot /opt/dpfl/bin/python -c 'import platform, torch, flwr, opacus, importlib.metadata as m
print("arm64 venv:", platform.machine(), "python", platform.python_version(), "| torch", torch.__version__,
      "(CUDA built:", torch.backends.cuda.is_built(), ") | flwr", flwr.__version__, "| opacus",
      opacus.__version__, "| dpfl", m.version("dpfl"))'
"$venv_bin/python" -c 'import platform, torch, flwr, opacus
print("x86 venv:  ", platform.machine(), "python", platform.python_version(), "| torch", torch.__version__,
      "| flwr", flwr.__version__, "| opacus", opacus.__version__)'
echo "start-up (python -c 'import torch, opacus, flwr', what each ClientApp process pays):"
for side in x86 arm64; do
  t0=$EPOCHREALTIME
  if [ $side = x86 ]; then "$venv_bin/python" -c 'import torch, opacus, flwr'
  else in_chroot /opt/dpfl/bin/python -c 'import torch, opacus, flwr'; fi
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v s=$side 'BEGIN { printf "  %-5s %.1f s\n", s, b - a }'
done

# -- 4. the federation ---------------------------------------------------------------------------
say "4. federation in network namespace $ns (loopback only): SuperLink with TLS + SuperNode auth"
ip netns add "$ns"; ns_made=1
ip -n "$ns" link set lo up
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
  FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PYTHONWARNINGS=ignore PATH="$venv_bin:$PATH"
mkdir -p "$state/flwr-home"
printf '[superlink]\ndefault = "arm64demo"\n\n[superlink.arm64demo]\naddress = "127.0.0.1:9093"\nroot-certificates = "%s"\n' \
  "$state/certs/ca.crt" > "$state/flwr-home/config.toml"
FLWR_HOME=$state/superlink-home start_bg superlink nice -n 19 flower-superlink \
  --ssl-ca-certfile "$state/certs/ca.crt" --ssl-certfile "$state/certs/superlink.crt" \
  --ssl-keyfile "$state/certs/superlink.key" --enable-supernode-auth \
  --fleet-api-address 127.0.0.1:9092 --host 127.0.0.1 --port 9093 \
  --database "$state/superlink.db" --disable-runtime-dependency-installation
wait_port 9092
wait_port 9093
for i in 0 1; do
  FLWR_HOME=$state/flwr-home ip netns exec "$ns" flwr supernode register \
    "$state/certs/keys/supernode-$i.pub" arm64demo 2>&1 | tail -1
done
echo "x86_64 SuperNode: partition 0, TLS + key supernode-0"
OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads DPFL_NUM_THREADS=$threads \
FLWR_HOME=$state/node-0-home start_bg supernode-x86 nice -n 19 flower-supernode \
  --superlink 127.0.0.1:9092 --root-certificates "$state/certs/ca.crt" \
  --auth-supernode-private-key "$state/certs/keys/supernode-0" --port 9096 \
  --node-config "partition-id=0 num-partitions=2" --max-retries 20 --max-wait-time 300
# the arm64 SuperNode: the installed unit's ExecStart, with supernode.env as its environment
unit=$rootfs/etc/dpfl/dpfl-supernode.service
exec_start=$(awk '/^ExecStart=/{f=1; sub(/^ExecStart=/, "")}
  f{ if (sub(/\\$/, "")) printf "%s ", $0; else { print; exit } }' "$unit")
node_env=()
while IFS= read -r line; do
  [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] && node_env+=("$line")
done < "$rootfs/etc/dpfl/supernode.env"
mapfile -d '' node_cmd < <(env -i "${node_env[@]}" bash -c "eval \"set -- \$1\"; printf '%s\0' \"\$@\"" _ "$exec_start")
echo "arm64 SuperNode: the unit's ExecStart in the chroot, environment = /etc/dpfl/supernode.env:"
echo "  chroot $rootfs $(printf "%q " "${node_cmd[@]}")"
start_bg supernode-arm64 nice -n 19 env -i "${node_env[@]}" /usr/sbin/chroot "$rootfs" \
  /bin/sh -c 'cd /var/lib/dpfl && exec "$@"' sh "${node_cmd[@]}"
echo "waiting for both SuperNodes to connect (the arm64 one starts under emulation)"
for _ in $(seq 1 300); do
  online=$(FLWR_HOME=$state/flwr-home ip netns exec "$ns" flwr supernode list arm64demo --format json 2>/dev/null \
    | "$venv_bin/python" -c 'import json, sys
d = json.load(sys.stdin); print(sum(n.get("status") == "online" for n in d.get("nodes", [])))' 2>/dev/null || echo 0)
  [ "$online" = 2 ] && break
  for f in "$state/supernode-x86.pid" "$state/supernode-arm64.pid"; do
    kill -0 "$(cat "$f")" 2>/dev/null \
      || { echo "$me: $(basename "$f" .pid) exited: $(tail -1 "${f%.pid}.log")" >&2; exit 1; }
  done
  sleep 2
done
[ "$online" = 2 ] || { echo "$me: the SuperNodes did not both connect within 10 min" >&2; exit 1; }
FLWR_HOME=$state/flwr-home ip netns exec "$ns" flwr supernode list arm64demo 2>&1 | grep -v '^\s*$' || true

# -- 5. the DP run -------------------------------------------------------------------------------
say "5. flwr run: $rounds DP-SGD rounds, MNIST train-subset $subset over 2 partitions"
run_config="num-rounds=$rounds train-subset=$subset output-dir=\"$state/runs\" run-name=\"arm64-demo\""
echo "\$ flwr run $repo arm64demo --stream --run-config \"$run_config\""
FLWR_HOME=$state/flwr-home DPFL_OUTPUT_ROOT=$state ip netns exec "$ns" \
  flwr run "$repo" arm64demo --stream --run-config "$run_config" > "$state/flwr-run.log" 2>&1 &
echo $! > "$state/flwr-run.pid"
pidfiles+=("$state/flwr-run.pid")
tail -n +1 -f --pid="$(cat "$state/flwr-run.pid")" "$state/flwr-run.log" &
wait "$(cat "$state/flwr-run.pid")" || { echo "$me: flwr run failed: $(tail -1 "$state/flwr-run.log")" >&2; exit 1; }
sleep 1
run_dir=$state/runs/arm64-demo
[ -f "$run_dir/summary.json" ] || { echo "$me: the run wrote no summary.json (see $state/flwr-run.log)" >&2; exit 1; }

say "results"
"$venv_bin/python" - "$run_dir" "$state/flwr-run.log" <<'PY'
import json, re, sys
from pathlib import Path
run, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line]
replies = {}  # (round, client) -> seconds from the round's push to the reply
for r, client, s in re.findall(r"round (\d+): (client-\d+) replied \(\d+/\d+, (\d+) s\)", log):
    replies[(int(r), client)] = int(s)
names = {"client-0": "x86_64 (native)", "client-1": "aarch64 (qemu)"}
print("reply time per round (s, from the instruction's push to the client's reply):")
print(f"{'round':>5} | {'client-0 x86_64':>15} | {'client-1 aarch64':>16} | {'ratio':>6} | round total")
for line in rounds:
    r = line["round"]
    a, b = replies.get((r, "client-0")), replies.get((r, "client-1"))
    ratio = f"{b / a:6.1f}" if a and b else "     -"
    print(f"{r:>5} | {a if a is not None else '-':>15} | {b if b is not None else '-':>16} | {ratio} | "
          f"{line['seconds']:.1f} s  (accuracy {line['central']['accuracy']:.4f}, "
          f"{[c + ': ' + v['status'] for c, v in sorted(line['clients'].items())]})")
ledger = json.loads((run / "ledger.json").read_text())
print("privacy ledger (server side), client-1 = the arm64 SuperNode:")
print(json.dumps({k: ledger[k] for k in ("delta", "accountant", "mismatches")}))
print(json.dumps({"client-1": ledger["clients"].get("client-1")}, indent=1))
PY
PYTHONPATH=$repo "$venv_bin/python" -c 'import sys; from dpfl.cli import main; sys.exit(main(["summary", sys.argv[1]]))' "$run_dir" || true
for f in rounds.jsonl ledger.json summary.json config.json; do
  [ "$out" = "$state" ] || cp "$run_dir/$f" "$out/$f"
done
say "stopping: SuperNodes, SuperLink (by PID), namespace, mounts"
