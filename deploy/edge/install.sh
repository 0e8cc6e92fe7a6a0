#!/usr/bin/env bash
# Install a dpfl SuperNode as a systemd service on a small Linux device (ARM64 or x86_64).
#
#   sudo deploy/edge/install.sh --superlink HOST:9092 --ca ca.crt --key supernode-3 \
#        --partition-id 3 --num-partitions 8 [--threads 2] [--memory-max 1500M] \
#        [--cpu-quota 150%] [--wheel dist/dpfl-0.1.0-py3-none-any.whl] [--prefix /opt/dpfl] \
#        [--torch torch==<v>] [--etc /etc/dpfl] [--start-window 300] [--dry-run | --no-service]
#
# What it does, all of it visible below:
#  1. a venv in PREFIX with CPU torch (on ARM64 the default is torch<2.11: PyPI's aarch64
#     torch wheels are CPU-only up to 2.10, from 2.11 on they are CUDA builds that pull the
#     CUDA toolkit, GBs a CPU-only device cannot use; on x86_64 pass PIP_EXTRA_INDEX_URL for
#     a CPU index, or --torch torch==<v>+cpu from a local file),
#     and dpfl[mnist] from --wheel or this checkout (no torchvision, no Ray: a SuperNode needs
#     neither);
#  2. /etc/dpfl/: the CA certificate and the SuperNode's private key (0600), and
#     supernode.env (address, node config, thread limits);
#  3. /etc/systemd/system/dpfl-supernode.service (from dpfl-supernode.service here): TLS with
#     the CA, SuperNode authentication with the key, unlimited reconnect attempts with
#     Flower's exponential back-off, restarted by systemd 15 s after any exit, CPU and memory
#     caps; then enables and starts it.
# --start-window S: seconds a ClientApp process may take from launch to its first heartbeat
#     (python -m dpfl.runtime.supernode; Flower's own window is a fixed 30 s, which a slow
#     device misses while Python imports torch and flwr; default 300).
# Batch: the run's batch size is part of its privacy accounting (the sampling rate), so the
# device does not change it; what the device bounds is threads, memory and CPU share.
# Register the key's .pub on the SuperLink side first: flwr supernode register KEY.pub <conn>.
# --dry-run prints the files it would write and installs nothing.
# --no-service does steps 1 and 2 and writes the rendered unit to ETC/dpfl-supernode.service
# only (no /etc/systemd/system, no systemctl): for a chroot or container without systemd,
# whose supervisor then runs the unit's ExecStart with supernode.env as its environment
# (deploy/edge/arm64-demo.sh does so in an arm64 chroot).
# Every argument is checked before anything is written (a bad one: one line on stderr naming
# it, exit 2); without --dry-run also root, python3's venv module and (without --no-service)
# systemctl.
set -euo pipefail
me=deploy/edge/install.sh
. "$(dirname "$0")/../lib.sh"  # die, require_engine
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
superlink="" ca="" key="" pid="" nparts="" threads=2 memory_max=1500M cpu_quota=150%
wheel="" prefix=/opt/dpfl torch_spec="" dry_run=0 service=1 etc=/etc/dpfl start_window=300
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run|--no-service) ;;
    --*) [ $# -ge 2 ] || die 2 "$1 needs a value (see the header of $me)" ;;
  esac
  case "$1" in
    --superlink) superlink=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --key) key=$2; shift 2 ;;
    --partition-id) pid=$2; shift 2 ;;
    --num-partitions) nparts=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --memory-max) memory_max=$2; shift 2 ;;
    --cpu-quota) cpu_quota=$2; shift 2 ;;
    --wheel) wheel=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    --torch) torch_spec=$2; shift 2 ;;
    --etc) etc=$2; shift 2 ;;
    --start-window) start_window=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --no-service) service=0; shift ;;
    *) die 2 "unknown argument '$1' (see the header of $me)" ;;
  esac
done
for v in superlink ca key pid nparts; do
  [ -n "${!v}" ] || die 2 "missing --${v/nparts/num-partitions} (see the header of $me)"
done
[ -f "$ca" ] || die 2 "--ca '$ca': no such file (the federation's CA certificate)"
[ -f "$key" ] || die 2 "--key '$key': no such file (this SuperNode's private key)"
[[ $superlink =~ ^[^[:space:]|]+:[0-9]{1,5}$ ]] && [ "${superlink##*:}" -ge 1 ] && [ "${superlink##*:}" -le 65535 ] \
  || die 2 "--superlink '$superlink': expected HOST:PORT, e.g. 10.0.0.1:9092"
[[ $nparts =~ ^[1-9][0-9]{0,5}$ ]] || die 2 "--num-partitions '$nparts': expected a whole number >= 1"
[[ $pid =~ ^(0|[1-9][0-9]{0,5})$ ]] && [ "$pid" -lt "$nparts" ] \
  || die 2 "--partition-id '$pid': expected a whole number 0..$((nparts - 1)) (below --num-partitions)"
[[ $threads =~ ^[1-9][0-9]{0,3}$ ]] || die 2 "--threads '$threads': expected a whole number >= 1"
[[ $memory_max =~ ^([1-9][0-9]*[KMGT]?|[1-9][0-9]?%|100%|infinity)$ ]] \
  || die 2 "--memory-max '$memory_max': expected a systemd MemoryMax, e.g. 1500M, 2G or 50%"
[[ $start_window =~ ^[1-9][0-9]{1,3}$ ]] && [ "$start_window" -ge 30 ] && [ "$start_window" -le 3600 ] \
  || die 2 "--start-window '$start_window': expected whole seconds 30..3600"
[[ $cpu_quota =~ ^[1-9][0-9]*%$ ]] || die 2 "--cpu-quota '$cpu_quota': expected a percentage, e.g. 150%"
for v in prefix etc; do
  [[ ${!v} == /* && ${!v} != *[[:space:]\|]* ]] || die 2 "--$v '${!v}': expected an absolute path without spaces or '|'"
done
[ -z "$wheel" ] || [ -f "$wheel" ] || die 2 "--wheel '$wheel': no such file"
if [ -z "$torch_spec" ]; then
  case "$(uname -m)" in
    aarch64|arm64) torch_spec="torch<2.11" ;;  # the last CPU-only aarch64 wheels (see above)
    *) torch_spec=torch ;;
  esac
fi
[ "$dry_run" = 0 ] || [ "$service" = 1 ] || die 2 "--dry-run and --no-service exclude each other (--dry-run installs nothing)"
if [ "$dry_run" = 0 ]; then
  [ "$(id -u)" = 0 ] || die 2 "needs root: it writes /etc/systemd/system, $etc and $prefix and starts a service; run it with sudo (or --dry-run)"
  [ "$service" = 0 ] || command -v systemctl > /dev/null \
    || die 2 "'systemctl' not found: this installs a systemd service (--no-service installs the venv and $etc only)"
  python3 -c 'import ensurepip, venv' 2> /dev/null \
    || die 2 "python3 with the venv module is needed (apt-get install python3-venv)"
fi

env_file=$(cat <<ENV
# dpfl SuperNode settings (read by dpfl-supernode.service)
DPFL_SUPERLINK=$superlink
# the SuperNode starts flower-superexec (and that flwr-clientapp) by name: the venv first
PATH=$prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DPFL_NODE_CONFIG=partition-id=$pid num-partitions=$nparts
# the node's own durable privacy history (dpfl.client.node_history)
DPFL_PRIVACY_DIR=/var/lib/dpfl/privacy
DPFL_NUM_THREADS=$threads
# seconds a ClientApp process may take to start (python -m dpfl.runtime.supernode;
# Flower's is 30)
DPFL_CLIENTAPP_START_WINDOW=$start_window
OMP_NUM_THREADS=$threads
MKL_NUM_THREADS=$threads
FLWR_HOME=/var/lib/dpfl/flwr
FLWR_TELEMETRY_ENABLED=0
FLWR_DISABLE_UPDATE_CHECK=1
FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
PYTHONWARNINGS=ignore
ENV
)
unit=$(sed -e "s|@PREFIX@|$prefix|g" -e "s|@ETC@|$etc|g" -e "s|@MEMORY_MAX@|$memory_max|g" \
           -e "s|@CPU_QUOTA@|$cpu_quota|g" "$here/dpfl-supernode.service")
if [ "$dry_run" = 1 ]; then
  printf '== %s/supernode.env\n%s\n== /etc/systemd/system/dpfl-supernode.service\n%s\n' \
    "$etc" "$env_file" "$unit"
  exit 0
fi
python3 -m venv "$prefix"
"$prefix/bin/pip" install -q --upgrade pip
"$prefix/bin/pip" install -q "$torch_spec"
"$prefix/bin/pip" install -q "${wheel:-$repo}[mnist]"
install -d -m 0755 "$etc" /var/lib/dpfl
install -m 0644 "$ca" "$etc/ca.crt"
install -m 0600 "$key" "$etc/supernode.key"
printf '%s\n' "$env_file" > "$etc/supernode.env"
if [ "$service" = 0 ]; then
  printf '%s\n' "$unit" > "$etc/dpfl-supernode.service"
  echo "dpfl SuperNode installed in $prefix (no service: the unit is $etc/dpfl-supernode.service)"
  exit 0
fi
printf '%s\n' "$unit" > /etc/systemd/system/dpfl-supernode.service
systemctl daemon-reload
systemctl enable --now dpfl-supernode.service
echo "dpfl-supernode installed; logs: journalctl -u dpfl-supernode -f"
