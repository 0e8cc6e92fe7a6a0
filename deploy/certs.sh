#!/usr/bin/env bash
# Make the TLS and SuperNode-authentication material for a dpfl deployment.
#
#   deploy/certs.sh OUT_DIR --san IP:10.0.0.1 --san DNS:superlink.example [--nodes 2]
#
# OUT_DIR/ca.crt, ca.key                  a private CA (keep ca.key offline)
# OUT_DIR/superlink.crt, superlink.key    the SuperLink's server certificate; its SANs are
#                                         the addresses SuperNodes and `flwr` dial
#                                         (127.0.0.1 and localhost are always added)
# OUT_DIR/keys/supernode-<i>{,.pub}       an ECDSA P-384 key pair per SuperNode (Flower's
#                                         SuperNode auth format, as `ssh-keygen` writes it)
#
# Then: SuperLink   --ssl-ca-certfile ca.crt --ssl-certfile superlink.crt
#                   --ssl-keyfile superlink.key --enable-supernode-auth
#       register    flwr supernode register keys/supernode-<i>.pub <connection>
#       SuperNode   --root-certificates ca.crt --auth-supernode-private-key keys/supernode-<i>
set -euo pipefail
out=${1:?usage: deploy/certs.sh OUT_DIR --san IP:x.x.x.x [--san DNS:name] [--nodes N] [--days D]}
shift
sans=("IP:127.0.0.1" "DNS:localhost")
nodes=2
days=365
while [ $# -gt 0 ]; do
  case "$1" in
    --san) sans+=("$2"); shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --days) days=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out/keys"
cd "$out"
san_list=$(IFS=,; echo "${sans[*]}")

openssl req -x509 -newkey rsa:3072 -nodes -days "$days" -subj "/CN=dpfl CA" \
  -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey rsa:3072 -nodes -subj "/CN=dpfl SuperLink" \
  -keyout superlink.key -out superlink.csr 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$san_list" > superlink.ext
openssl x509 -req -in superlink.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
  -extfile superlink.ext -out superlink.crt 2>/dev/null
rm -f superlink.csr superlink.ext ca.srl
chmod 600 ca.key superlink.key

for i in $(seq 0 $((nodes - 1))); do
  rm -f "keys/supernode-$i" "keys/supernode-$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "dpfl-supernode-$i" -f "keys/supernode-$i"
done
echo "CA, SuperLink certificate (SANs: $san_list) and $nodes SuperNode key pairs in $out"
