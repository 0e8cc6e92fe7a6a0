#!/bin/sh
# dpfl container entry point: the first argument names the Flower role, the rest are that
# role's own options (exec'd, so the Flower process gets the stop signal directly).
#   superlink  -> flower-superlink            (SuperLink: Fleet API 9092, Control/Runtime 9093)
#   serverapp  -> flower-superexec   (ServerApp SuperExec; in the SuperLink's network namespace:
#                 --runtime-api-address 127.0.0.1:9093)
#   supernode  -> python -m dpfl.runtime.supernode --warm-clientapps  (flower-supernode whose
#                 ClientApps are forked from a process that imported torch, Opacus and Flower
#                 once: dpfl/runtime/warm_clientapps.py; DPFL_COLD_CLIENTAPPS=1: plain
#                 flower-supernode)
#   clientapp  -> flower-superexec   (ClientApp SuperExec, for `supernode --isolation process`)
#   operator   -> flwr                (the operator's CLI; run it in the SuperLink's network
#                 namespace: its Control API listens on 127.0.0.1:9093 there and nowhere else)
# Anything else is run as given (e.g. `dpfl-role python -c ...`).
# operator writes $FLWR_HOME/config.toml with one connection, "superlink", to
# ${DPFL_CONTROL_ADDRESS:-127.0.0.1:9093} verified with /certs/ca.crt (DPFL_INSECURE=1: plaintext),
# then runs `flwr ARGS`, e.g. `operator supernode register /certs/keys/supernode-0.pub superlink`.
set -e
role=${1:---help}
[ $# -gt 0 ] && shift
case "$role" in
  superlink) exec flower-superlink "$@" ;;
  serverapp) exec flower-superexec "$@" ;;
  supernode)
    if [ "${DPFL_COLD_CLIENTAPPS:-0}" = 1 ]; then exec flower-supernode "$@"; fi
    exec python -m dpfl.runtime.supernode --warm-clientapps "$@" ;;
  clientapp) exec flower-superexec "$@" ;;
  operator)
    if [ "${DPFL_INSECURE:-0}" = 1 ]; then
      tls="insecure = true"
    else
      [ -f /certs/ca.crt ] || { echo "dpfl-role operator: /certs/ca.crt missing (mount the CA certificate, or DPFL_INSECURE=1 for a plaintext SuperLink)" >&2; exit 2; }
      tls='root-certificates = "/certs/ca.crt"'
    fi
    mkdir -p "$FLWR_HOME"
    printf '[superlink]\ndefault = "superlink"\n\n[superlink.superlink]\naddress = "%s"\n%s\n' \
      "${DPFL_CONTROL_ADDRESS:-127.0.0.1:9093}" "$tls" > "$FLWR_HOME/config.toml"
    exec flwr "$@" ;;
  -h|--help)
    echo "usage: <image> superlink|serverapp|supernode|clientapp|operator [options]"
    exit 0 ;;
  *) exec "$role" "$@" ;;
esac
