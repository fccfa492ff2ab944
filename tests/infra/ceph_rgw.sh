#!/bin/bash
# Start or stop a single-node Ceph cluster (mon + memstore OSD + RGW, optional mgr) on 127.0.0.1.
#
#   tests/infra/ceph_rgw.sh start [DIR]   # prints `export DTKV_S3_*=...` lines on stdout when ready
#   tests/infra/ceph_rgw.sh stop  [DIR]
#
# Installs nothing: needs Debian's `radosgw ceph-mon ceph-osd` (and `ceph-mgr` if CEPH_MGR=1).
# Env: CEPH_DIR (default $DIR or /tmp/dtkv-ceph), RGW_PORT (7480), MON_PORT_V2 (3300), MON_PORT_V1
# (6789), OBJSTORE (memstore|bluestore), CEPH_MGR (0: RGW does not need the mgr for I/O; saves
# ~300 MB), S3_ACCESS_KEY / S3_SECRET_KEY (testing/testing). Logs: $CEPH_DIR/log/*.log.
# cephx stays on: with auth "none" radosgw never connects (get_initial_auth_request -13).
set -euo pipefail
cmd=${1:-start}
D=${2:-${CEPH_DIR:-/tmp/dtkv-ceph}}
RGW_PORT=${RGW_PORT:-7480}
MON2=${MON_PORT_V2:-3300}
MON1=${MON_PORT_V1:-6789}
AK=${S3_ACCESS_KEY:-testing}
SK=${S3_SECRET_KEY:-testing}
log() { echo "ceph_rgw: $*" >&2; }

stop() {
  [ -f "$D/pids" ] || return 0
  # Our own daemons only, by recorded pid, RGW first so clients see a clean close.
  tac "$D/pids" | while read -r _name pid; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    alive=0
    while read -r _name pid; do kill -0 "$pid" 2>/dev/null && alive=1; done < "$D/pids"
    [ $alive = 0 ] && break
    sleep 0.1
  done
  while read -r _name pid; do kill -9 "$pid" 2>/dev/null || true; done < "$D/pids"
  rm -f "$D/pids"
}

if [ "$cmd" = stop ]; then stop; log "stopped"; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop [DIR]" >&2; exit 2; }
for b in ceph-mon ceph-osd radosgw ceph-authtool monmaptool radosgw-admin ceph; do
  command -v "$b" >/dev/null || { log "missing $b: apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd ceph-mgr"; exit 3; }
done
stop
rm -rf "$D"; mkdir -p "$D"/{run,log,mon.a,mgr.x,osd0,rgw}
FSID=$(cat /proc/sys/kernel/random/uuid)
cat > "$D/ceph.conf" <<CONF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:$MON2,v1:127.0.0.1:$MON1
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
mon warn on insecure global id reclaim allowed = false
run dir = $D/run
admin socket = $D/run/\$name.asok
log file = $D/log/\$name.log
pid file = $D/run/\$name.pid
keyring = $D/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 0
[mon]
mon data = $D/mon.\$id
[mgr]
mgr data = $D/mgr.\$id
[osd]
osd data = $D/osd\$id
osd objectstore = ${OBJSTORE:-memstore}
memstore device bytes = ${MEMSTORE_BYTES:-4294967296}
bluestore block create = true
bluestore block size = 8589934592
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mkfs = false
bluestore cache size = 268435456
osd max object name len = 460
osd max object namespace len = 64
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $D/rgw
rgw dns name = localhost
# memstore only frees deleted objects after RGW's gc runs (default: 2 h later); benchmarks and
# tests delete what they write, so collect quickly.
rgw gc obj min wait = 30
rgw gc processor period = 30
rgw gc processor max time = 30
CONF
C=(-c "$D/ceph.conf")
ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$D/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
ceph-authtool "$D/keyring" --gen-key -n mgr.x --cap mon 'allow profile mgr' --cap osd 'allow *' --cap mds 'allow *' >/dev/null
ceph-authtool "$D/keyring" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd' >/dev/null
ceph-authtool "$D/keyring" --gen-key -n client.rgw.a --cap mon 'allow rw' --cap osd 'allow rwx' --cap mgr 'allow rw' >/dev/null
monmaptool --create --addv a "[v2:127.0.0.1:$MON2,v1:127.0.0.1:$MON1]" --fsid "$FSID" "$D/monmap" >/dev/null
ceph-mon "${C[@]}" --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon "${C[@]}" -i a -f >>"$D/log/mon.out" 2>&1 & echo "mon $!" >> "$D/pids"
ok=0
for _ in $(seq 1 100); do ceph "${C[@]}" -s --connect-timeout 2 >/dev/null 2>&1 && { ok=1; break; }; sleep 0.2; done
[ $ok = 1 ] || { log "mon did not start; see $D/log"; stop; exit 1; }
if [ "${CEPH_MGR:-0}" = 1 ]; then ceph-mgr "${C[@]}" -i x -f >>"$D/log/mgr.out" 2>&1 & echo "mgr $!" >> "$D/pids"; fi
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
ID=$(ceph "${C[@]}" osd new "$OSD_UUID" 0)
ceph-osd "${C[@]}" -i "$ID" --mkfs --osd-uuid "$OSD_UUID" >>"$D/log/osd.out" 2>&1
ceph-osd "${C[@]}" -i "$ID" -f >>"$D/log/osd.out" 2>&1 & echo "osd $!" >> "$D/pids"
ok=0
for _ in $(seq 1 200); do ceph "${C[@]}" osd stat 2>/dev/null | grep -q '1 up' && { ok=1; break; }; sleep 0.3; done
[ $ok = 1 ] || { log "osd did not come up; see $D/log"; stop; exit 1; }
radosgw "${C[@]}" -n client.rgw.a -f >>"$D/log/rgw.out" 2>&1 & echo "rgw $!" >> "$D/pids"
ok=0
for _ in $(seq 1 600); do
  if (exec 3<>/dev/tcp/127.0.0.1/"$RGW_PORT") 2>/dev/null; then ok=1; break; fi
  sleep 0.2
done
[ $ok = 1 ] || { log "radosgw did not answer on $RGW_PORT; see $D/log"; stop; exit 1; }
radosgw-admin "${C[@]}" user create --uid=dtkv --display-name=dtkv --access-key="$AK" --secret-key="$SK" >/dev/null
log "ready in ${SECONDS}s (dir $D)"
echo "export DTKV_S3_ENDPOINT=http://127.0.0.1:$RGW_PORT"
echo "export DTKV_S3_ACCESS_KEY=$AK"
echo "export DTKV_S3_SECRET_KEY=$SK"
