#!/usr/bin/env bash
# Make the TLS and SuperNode-authentication material for a dpfl deployment.
#
#   deploy/certs.sh OUT_DIR --san IP:10.0.0.1 --san DNS:superlink.example [--nodes 2] [--days 365]
#                   [--force]
#
# OUT_DIR must not exist or be empty: a CA and keys already there may be in use by a running
# federation. --force replaces them: the old folder is kept beside it as
# OUT_DIR.replaced-<time> (nothing is overwritten file by file).
#
# OUT_DIR/ca.crt, ca.key                  a private CA (keep ca.key offline)
# OUT_DIR/superlink.crt, superlink.key    the SuperLink's server certificate; its SANs are
#                                         the addresses SuperNodes and `flwr` dial
#                                         (127.0.0.1 and localhost are always added)
#                                         (the CA's and the SuperLink's keys are ECDSA P-384,
#                                         as strong as RSA-7680: an RSA-3072 key took ~1.1 s
#                                         of CPU to generate here, an ECDSA one ~10 ms)
# OUT_DIR/keys/supernode-<i>{,.pub}       an ECDSA P-384 key pair per SuperNode (Flower's
#                                         SuperNode auth format, as `ssh-keygen` writes it)
#
# Then: SuperLink   --ssl-ca-certfile ca.crt --ssl-certfile superlink.crt
#                   --ssl-keyfile superlink.key --enable-supernode-auth
#       register    flwr supernode register keys/supernode-<i>.pub <connection>
#       SuperNode   --root-certificates ca.crt --auth-supernode-private-key keys/supernode-<i>
#
# Every argument is checked before anything is written (a bad one: one line on stderr naming
# it, exit 2). The material is made in a temporary folder and moved into OUT_DIR only when all
# of it exists; a failing openssl/ssh-keygen stops the script (one line, exit 1) and leaves
# OUT_DIR as it was.
set -euo pipefail
me=deploy/certs.sh
usage="usage: $me OUT_DIR [--san IP:x.x.x.x] [--san DNS:name] [--nodes N] [--days D] [--force]"

. "$(dirname "$0")/lib.sh"  # die, require_engine

valid_ipv4() {  # four decimal octets 0..255
  local IFS=. octet
  [[ $1 =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] || return 1
  for octet in $1; do [ $((10#$octet)) -le 255 ] || return 1; done
}

valid_ipv6_groups() {  # valid_ipv6_groups TEXT: '' or 1-4 hex digit groups joined by ':'; prints count
  [ -z "$1" ] && { echo 0; return 0; }
  [[ $1 =~ ^[0-9A-Fa-f]{1,4}(:[0-9A-Fa-f]{1,4})*$ ]] || return 1
  local IFS=: groups
  read -ra groups <<< "$1"
  echo "${#groups[@]}"
}

valid_ipv6() {  # 8 groups, or fewer with one '::'
  local left right n m
  if [[ $1 == *::* ]]; then
    left=${1%%::*} right=${1#*::}
    [[ $right == *::* ]] && return 1
    n=$(valid_ipv6_groups "$left") && m=$(valid_ipv6_groups "$right") || return 1
    [ $((n + m)) -le 7 ]
  else
    n=$(valid_ipv6_groups "$1") || return 1
    [ "$n" -eq 8 ]
  fi
}

valid_dns() {  # dot-separated labels of letters, digits, '-', '_' (an optional leading '*.')
  local label='[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?'
  [ ${#1} -le 253 ] && [[ $1 =~ ^(\*\.)?$label(\.$label)*\.?$ ]]
}

check_san() {  # check_san SAN: IP:<IPv4|IPv6> or DNS:<name>, else exit 2 naming it
  case "$1" in
    IP:*) valid_ipv4 "${1#IP:}" || valid_ipv6 "${1#IP:}" \
            || die 2 "--san '$1': '${1#IP:}' is not an IPv4 or IPv6 address" ;;
    DNS:*) valid_dns "${1#DNS:}" \
            || die 2 "--san '$1': '${1#DNS:}' is not a DNS name (letters, digits, '-', '.')" ;;
    *) die 2 "--san '$1': expected IP:<address> or DNS:<name>, e.g. IP:10.0.0.1 or DNS:superlink" ;;
  esac
}

run() {  # run STEP COMMAND...: the command's stderr goes to a log; on failure one line, exit 1
  local rc=0
  "${@:2}" 2> "$tmp/.stderr" > /dev/null || rc=$?
  [ "$rc" = 0 ] && return 0
  die 1 "$1 failed ($2 exit $rc): $(grep -v '^[[:space:]]*$' "$tmp/.stderr" | tail -1)"
}

# -- arguments, all checked before anything is written ----------------------------------------
[ $# -gt 0 ] && [[ $1 != -* ]] || die 2 "OUT_DIR missing ($usage)"
out=$1
shift
sans=("IP:127.0.0.1" "DNS:localhost")
nodes=2
days=365
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --san|--nodes|--days) [ $# -ge 2 ] || die 2 "$1 needs a value ($usage)" ;;
  esac
  case "$1" in
    --san) check_san "$2"; sans+=("$2"); shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --days) days=$2; shift 2 ;;
    --force) force=1; shift ;;
    *) die 2 "unknown argument '$1' ($usage)" ;;
  esac
done
[[ $nodes =~ ^(0|[1-9][0-9]{0,3})$ ]] || die 2 "--nodes '$nodes': expected a whole number 0..9999"
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || die 2 "--days '$days': expected a whole number 1..99999"
if [ -e "$out" ] && [ ! -d "$out" ]; then die 2 "OUT_DIR '$out' exists and is not a directory"; fi
if [ -e "$out/keys" ] && [ ! -d "$out/keys" ]; then die 2 "'$out/keys' exists and is not a directory"; fi
for tool in openssl ssh-keygen; do
  command -v "$tool" > /dev/null || die 2 "'$tool' not found on PATH (apt-get install openssl openssh-client)"
done
parent=$(dirname "$out")
while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
[ -d "$parent" ] && [ -w "$parent" ] || die 2 "OUT_DIR '$out': cannot create it under '$parent' (not a writable directory)"
if [ -d "$out" ] && [ ! -w "$out" ]; then die 2 "OUT_DIR '$out' is not writable"; fi
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ] && [ "$force" = 0 ]; then
  die 2 "OUT_DIR '$out' is not empty (holds $(ls -A "$out" | head -n 4 | paste -sd, -)): its CA and keys may be in use; choose another folder, or --force to replace them (the old folder is kept as $out.replaced-<time>)"
fi

# -- the material, in a temporary folder --------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dpfl-certs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/keys"
san_list=$(IFS=,; echo "${sans[*]}")
run "openssl: the CA" openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -days "$days" \
  -subj "/CN=dpfl CA" -keyout "$tmp/ca.key" -out "$tmp/ca.crt"
run "openssl: the SuperLink key" openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes \
  -subj "/CN=dpfl SuperLink" \
  -keyout "$tmp/superlink.key" -out "$tmp/superlink.csr"
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' \
  "$san_list" > "$tmp/superlink.ext"
run "openssl: the SuperLink certificate (SANs $san_list)" openssl x509 -req \
  -in "$tmp/superlink.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days "$days" -extfile "$tmp/superlink.ext" -out "$tmp/superlink.crt"
rm -f "$tmp/superlink.csr" "$tmp/superlink.ext" "$tmp/ca.srl" "$tmp/.stderr"
chmod 600 "$tmp/ca.key" "$tmp/superlink.key"
for ((i = 0; i < nodes; i++)); do
  run "ssh-keygen: supernode-$i's key" ssh-keygen -q -t ecdsa -b 384 -N "" \
    -C "dpfl-supernode-$i" -f "$tmp/keys/supernode-$i"
done
rm -f "$tmp/.stderr"
for f in ca.crt ca.key superlink.crt superlink.key; do
  [ -s "$tmp/$f" ] || die 1 "openssl wrote no $f"
done

# -- into place: OUT_DIR becomes the whole new folder (an empty one is replaced; with --force a
# -- full one is moved aside first, never overwritten file by file) --------------------------
chmod "$(umask -S)" "$tmp"  # as `mkdir` would have made it (mktemp makes 0700)
replaced=""
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  replaced="$out.replaced-$(date +%Y%m%d-%H%M%S)"
  mv "$out" "$replaced"
elif [ -d "$out" ]; then
  rmdir "$out"
fi
mkdir -p "$(dirname "$out")"
mv "$tmp" "$out"
trap - EXIT
echo "CA, SuperLink certificate (SANs: $san_list) and $nodes SuperNode key pairs in $out${replaced:+ (the old folder is now $replaced)}"
