#!/usr/bin/env bash
# Install a dpfl SuperNode as a systemd service on a small Linux device (ARM64 or x86_64).
#
#   sudo deploy/edge/install.sh --superlink HOST:9092 --ca ca.crt --key supernode-3 \
#        --partition-id 3 --num-partitions 8 [--threads 2] [--memory-max 1500M] \
#        [--cpu-quota 150%] [--wheel dist/dpfl-0.1.0-py3-none-any.whl] [--prefix /opt/dpfl]
#
# What it does, all of it visible below:
#  1. a venv in PREFIX with CPU torch (on ARM64 PyPI's torch wheels are CPU-only; on x86_64
#     pass PIP_EXTRA_INDEX_URL for a CPU index, or --torch torch==<v>+cpu from a local file),
#     and dpfl[mnist] from --wheel or this checkout (no torchvision, no Ray: a SuperNode needs
#     neither);
#  2. /etc/dpfl/: the CA certificate and the SuperNode's private key (0600), and
#     supernode.env (address, node config, thread limits);
#  3. /etc/systemd/system/dpfl-supernode.service (from dpfl-supernode.service here): TLS with
#     the CA, SuperNode authentication with the key, unlimited reconnect attempts with
#     Flower's exponential back-off, restarted by systemd 15 s after any exit, CPU and memory
#     caps; then enables and starts it.
# Batch: the run's batch size is part of its privacy accounting (the sampling rate), so the
# device does not change it; what the device bounds is threads, memory and CPU share.
# Register the key's .pub on the SuperLink side first: flwr supernode register KEY.pub <conn>.
# --dry-run prints the files it would write and installs nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
superlink="" ca="" key="" pid="" nparts="" threads=2 memory_max=1500M cpu_quota=150%
wheel="" prefix=/opt/dpfl torch_spec=torch dry_run=0 etc=/etc/dpfl
while [ $# -gt 0 ]; do
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
    --dry-run) dry_run=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
for v in superlink ca key pid nparts; do
  [ -n "${!v}" ] || { echo "missing --${v/nparts/num-partitions} (see the header)" >&2; exit 2; }
done
[ -f "$ca" ] && [ -f "$key" ] || { echo "--ca and --key must be files" >&2; exit 2; }

env_file=$(cat <<ENV
# dpfl SuperNode settings (read by dpfl-supernode.service)
DPFL_SUPERLINK=$superlink
DPFL_NODE_CONFIG=partition-id=$pid num-partitions=$nparts
DPFL_NUM_THREADS=$threads
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
printf '%s\n' "$unit" > /etc/systemd/system/dpfl-supernode.service
systemctl daemon-reload
systemctl enable --now dpfl-supernode.service
echo "dpfl-supernode installed; logs: journalctl -u dpfl-supernode -f"
