#!/usr/bin/env bash
# A real single-node Ceph cluster with an S3 gateway on loopback, for ckptvault's S3 tests and benchmarks.
#
#   scripts/ceph-rgw.sh start [DIR]   install Ceph if missing (apt-get, needs root), start 1 mon, 1 OSD (bluestore on
#                                     a sparse file) and radosgw on 127.0.0.1, create an S3 user; prints the env file
#   scripts/ceph-rgw.sh stop DIR      kill the daemons by the PIDs recorded in DIR/pids, then remove DIR
#   scripts/ceph-rgw.sh install       only install the Ceph packages
#
# DIR (default: a new /tmp/ckv-rgw.XXXXXX) holds every byte of state; it must be short, because admin socket paths
# must stay under 108 bytes. After `start`, DIR/rgw.env holds shell assignments:
#   CKV_S3_ENDPOINT=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... CKV_RGW_DIR=DIR CKV_RGW_PIDS="..."
#   CKV_S3_TLS_ENDPOINT=https://127.0.0.1:PORT CKV_S3_CA=DIR/tls/cert.pem   (the same gateway over TLS, with a
#   self-signed certificate for 127.0.0.1 made by openssl at start; CKV_S3_CA is the CA bundle that verifies it)
# and the last line of stdout is the path of that file. With CKV_RGW_PARENT_PID=PID set, a watchdog runs `stop`
# once that process has exited (so a killed test run leaves no daemons behind). Exit status is non-zero, with the daemon logs' tails on
# stderr, if the gateway does not serve requests within CKV_RGW_TIMEOUT seconds (default 60).
#
# Settings below were measured to matter with Ceph 16.2.15 on Debian 12 (see docs/STORAGE.md):
# auth none needs `ms mon client mode = crc secure` or radosgw cannot fetch its config from the mon; the mon
# refuses to run on a disk with < 5% free unless `mon data avail crit` is lowered; memstore keeps every byte in
# the OSD's heap, so bluestore on a sparse file is used; the paxos/shard/aio settings cut startup from ~13 s to ~3 s.
set -euo pipefail

PACKAGES=(ceph-mon ceph-osd radosgw ceph-common openssl)
TIMEOUT=${CKV_RGW_TIMEOUT:-60}

log() { echo "ceph-rgw: $*" >&2; }
die() { log "error: $*"; exit 1; }
STARTING_DIR=""  # set while `start` runs: on failure its daemons are killed and its state removed

cleanup_failed_start() {
    local rc=$?
    if [ "$rc" -ne 0 ] && [ -n "$STARTING_DIR" ] && [ -f "$STARTING_DIR/pids" ]; then
        log "start failed: stopping the daemons it started and removing $STARTING_DIR"
        stop "$STARTING_DIR" >/dev/null 2>&1 || true
    fi
    exit "$rc"
}
trap cleanup_failed_start EXIT

install_ceph() {
    if command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v radosgw >/dev/null \
        && command -v radosgw-admin >/dev/null && command -v monmaptool >/dev/null && command -v openssl >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "Ceph is not installed and installing it needs root: apt-get install ${PACKAGES[*]}"
    command -v apt-get >/dev/null || die "Ceph is not installed and there is no apt-get to install ${PACKAGES[*]}"
    log "installing ${PACKAGES[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2 || die "apt-get install ${PACKAGES[*]} failed"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

write_conf() {  # DIR MON_PORT RGW_PORT TLS_PORT FSID
    local dir=$1 mon_port=$2 rgw_port=$3 tls_port=$4 fsid=$5
    cat >"$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
run dir = $dir/run
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
osd crush chooseleaf type = 0
mon data avail crit = 1
mon data avail warn = 2
mon warn on pool no redundancy = false
paxos propose interval = 0.05
osd op num shards = 2
bdev aio poll ms = 20
debug ms = 0
[mon]
mon data = $dir/mon/\$cluster-\$id
[osd]
osd data = $dir/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 20G
osd memory target = 939524096
bluestore cache autotune = false
bluestore cache size = 134217728
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port ssl_endpoint=127.0.0.1:$tls_port ssl_certificate=$dir/tls/cert.pem ssl_private_key=$dir/tls/key.pem tcp_nodelay=1
rgw data = $dir/rgw
rgw thread pool size = 64
EOF
}

start_daemon() {  # DIR NAME CMD...: run CMD in the foreground mode of the daemon, detached; record its PID
    local dir=$1 name=$2
    shift 2
    setsid "$@" </dev/null >>"$dir/log/$name.out" 2>&1 &
    echo "$!" >>"$dir/pids"
    echo "$!"
}

dump_logs() {
    local dir=$1 f
    for f in "$dir"/log/*; do
        [ -f "$f" ] || continue
        log "---- tail of $f"
        tail -n 15 "$f" >&2 || true
    done
}

wait_for() {  # DIR WHAT COMMAND...: retry COMMAND until it succeeds or TIMEOUT passes
    local dir=$1 what=$2 deadline=$((SECONDS + TIMEOUT))
    shift 2
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            dump_logs "$dir"
            die "$what did not come up within ${TIMEOUT}s (the tails of its logs are above)"
        fi
        sleep 0.1
    done
}

http_up() {  # URL: any HTTP answer counts
    python3 -c 'import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass' "$1"
}

start() {
    local dir=${1:-}
    install_ceph
    if [ -z "$dir" ]; then
        dir=$(mktemp -d /tmp/ckv-rgw.XXXXXX)
    else
        mkdir -p "$dir"
        dir=$(cd "$dir" && pwd)
        [ -z "$(ls -A "$dir")" ] || die "$dir is not empty"
    fi
    [ ${#dir} -le 60 ] || die "state directory $dir is too long: admin socket paths must stay under 108 bytes"
    mkdir -p "$dir"/{run,log,mon,osd/ceph-0,rgw,tls}
    : >"$dir/pids"
    STARTING_DIR=$dir
    local mon_port rgw_port tls_port fsid osd_uuid conf="$dir/ceph.conf"
    mon_port=$(free_port)
    rgw_port=$(free_port)
    tls_port=$(free_port)
    fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    openssl req -x509 -newkey rsa:2048 -nodes -days 7 -subj "/CN=127.0.0.1" -addext "subjectAltName=IP:127.0.0.1" \
        -keyout "$dir/tls/key.pem" -out "$dir/tls/cert.pem" >>"$dir/log/setup.out" 2>&1 || die "openssl could not make a certificate"
    write_conf "$dir" "$mon_port" "$rgw_port" "$tls_port" "$fsid"
    local c=(-c "$conf")

    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >>"$dir/log/setup.out" 2>&1 \
        || { dump_logs "$dir"; die "monmaptool failed"; }
    ceph-mon "${c[@]}" --mkfs -i a --monmap "$dir/monmap" >>"$dir/log/setup.out" 2>&1 || { dump_logs "$dir"; die "ceph-mon --mkfs failed"; }
    start_daemon "$dir" mon.a ceph-mon "${c[@]}" -f -i a >/dev/null
    wait_for "$dir" "ceph-mon" ceph "${c[@]}" --connect-timeout 5 mon stat

    ceph "${c[@]}" osd new "$osd_uuid" 0 >>"$dir/log/setup.out" 2>&1 || { dump_logs "$dir"; die "ceph osd new failed"; }
    ceph-osd "${c[@]}" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$dir/log/setup.out" 2>&1 || { dump_logs "$dir"; die "ceph-osd --mkfs failed"; }
    start_daemon "$dir" osd.0 ceph-osd "${c[@]}" -f -i 0 >/dev/null
    wait_for "$dir" "ceph-osd" osd_is_up "$conf"

    start_daemon "$dir" client.rgw.a radosgw "${c[@]}" -f -n client.rgw.a >/dev/null
    local endpoint="http://127.0.0.1:$rgw_port"
    wait_for "$dir" "radosgw at $endpoint" http_up "$endpoint"

    local access secret
    access=CKV$(python3 -c 'import secrets; print(secrets.token_hex(8).upper())')
    secret=$(python3 -c 'import secrets; print(secrets.token_hex(20))')
    radosgw-admin "${c[@]}" -n client.rgw.a user create --uid=ckptvault --display-name="ckptvault tests" \
        --access-key="$access" --secret="$secret" >>"$dir/log/setup.out" 2>&1 || { dump_logs "$dir"; die "radosgw-admin user create failed"; }

    if [ -n "${CKV_RGW_PARENT_PID:-}" ]; then  # stop the cluster when that process ends, even if it is killed
        setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; "$2" stop "$3" >/dev/null 2>&1' \
            watchdog "$CKV_RGW_PARENT_PID" "$(cd "$(dirname "$0")" && pwd)/$(basename "$0")" "$dir" </dev/null >/dev/null 2>&1 &
    fi
    local pids
    pids=$(tr '\n' ' ' <"$dir/pids" | sed 's/ $//')
    cat >"$dir/rgw.env" <<EOF
CKV_S3_ENDPOINT=$endpoint
CKV_S3_TLS_ENDPOINT=https://127.0.0.1:$tls_port
CKV_S3_CA=$dir/tls/cert.pem
AWS_ACCESS_KEY_ID=$access
AWS_SECRET_ACCESS_KEY=$secret
AWS_DEFAULT_REGION=us-east-1
CKV_RGW_DIR=$dir
CKV_RGW_PIDS="$pids"
EOF
    STARTING_DIR=""
    log "radosgw serves S3 at $endpoint (state in $dir; pids $pids; stop with: $0 stop $dir)"
    echo "$dir/rgw.env"
}

osd_is_up() {  # CONF
    ceph -c "$1" --connect-timeout 5 osd dump 2>/dev/null | grep -q '^osd\.0 up'
}

stop() {
    local dir=${1:-}
    [ -n "$dir" ] || die "usage: $0 stop DIR"
    [ -f "$dir/pids" ] || die "$dir/pids not found: is $dir a directory made by '$0 start'?"
    local pid pids
    pids=$(cat "$dir/pids")
    for pid in $pids; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    local deadline=$((SECONDS + 10))
    for pid in $pids; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    case "$dir" in
        /tmp/ckv-rgw.*) rm -rf "$dir" ;;  # made by start: all ours
        *) rm -rf "$dir"/{run,log,mon,osd,rgw,tls} "$dir"/{pids,rgw.env,ceph.conf,monmap} ;;
    esac
    log "stopped ${pids//$'\n'/ }"
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    install) install_ceph ;;
    *) echo "usage: $0 start [DIR] | stop DIR | install" >&2; exit 2 ;;
esac
