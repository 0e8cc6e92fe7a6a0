#!/bin/sh
# dpfl container entry point: the first argument names the Flower role, the rest are that
# role's own options (exec'd, so the Flower process gets the stop signal directly).
#   superlink  -> flower-superlink            (SuperLink: Fleet API 9092, Control/Runtime 9093)
#   serverapp  -> flower-superexec   (ServerApp SuperExec: --runtime-api-address superlink:9093)
#   supernode  -> flower-supernode            (SuperNode; ClientApps in subprocesses by default)
#   clientapp  -> flower-superexec   (ClientApp SuperExec, for `supernode --isolation process`)
# Anything else is run as given (e.g. `dpfl-role flwr ls`).
set -e
role=${1:---help}
[ $# -gt 0 ] && shift
case "$role" in
  superlink) exec flower-superlink "$@" ;;
  serverapp) exec flower-superexec "$@" ;;
  supernode) exec flower-supernode "$@" ;;
  clientapp) exec flower-superexec "$@" ;;
  -h|--help)
    echo "usage: <image> superlink|serverapp|supernode|clientapp [flower options]"
    exit 0 ;;
  *) exec "$role" "$@" ;;
esac
