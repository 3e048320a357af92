#!/bin/bash
# Runs inside the Soft-RoCE VM (started by tests/softroce/run): loads rdma_rxe, makes two rxe
# devices joined by a veth pair, mounts the venv's site-packages image, then runs the command
# from the repository.
# Arguments: REPO VENV SITE_PACKAGES ACCEL COMMAND [ARGS...].
set -u
repo=$1 venv=$2 site=$3 accel=$4
shift 4
t0=$(date +%s.%N)
say() { printf '[guest %6.1fs] %s\n' "$(echo "$(date +%s.%N) - $t0" | bc)" "$*"; }
fail() { say "setup failed: $*"; exit 2; }

modprobe rdma_rxe || fail "modprobe rdma_rxe"
ip link set lo up
# Two "hosts" joined by a switch: rxe0 on wtveth0 (10.99.0.1, the engines' host in the multi-host
# tests) and rxe1 on wtveth1 (10.99.0.2, the trainers'), each veth's other end a port of the
# bridge wtsw. rdma_rxe of this kernel (6.1) routes and listens only in the initial network
# namespace, so both ends live here; policy routing sends traffic between the two addresses
# through the bridge instead of through lo (packets leaving from one address to the other take
# that address's veth; the receiving end accepts a packet from a local address). The bridge is
# what makes a link fault real: with wtveth0 down the trainers' packets leave their host and are
# lost in the switch, so their queue pairs time out and retry as on a fabric. (With the two
# veths joined directly, the sending end's transmit fails locally and rxe of 6.1 retries the
# send at once, forever.)
ip link add wtsw type bridge || fail "bridge"
ip link set wtsw type bridge stp_state 0 forward_delay 0
ip link add wtveth0 type veth peer name wtsw0 || fail "veth"
ip link add wtveth1 type veth peer name wtsw1 || fail "veth"
ip link set wtsw0 master wtsw; ip link set wtsw1 master wtsw
ip addr add 10.99.0.1/24 dev wtveth0
ip addr add 10.99.0.2/24 dev wtveth1
for dev in all default lo wtveth0 wtveth1; do
    sysctl -qw net.ipv4.conf.$dev.rp_filter=0 2>/dev/null
    sysctl -qw net.ipv4.conf.$dev.accept_local=1 2>/dev/null
done
for dev in wtsw wtsw0 wtsw1 wtveth0 wtveth1; do ip link set "$dev" up; done
ip route add 10.99.0.1/32 dev wtveth1 table 201
ip route add 10.99.0.2/32 dev wtveth0 table 202
ip rule add pref 10 iif lo from 10.99.0.2 to 10.99.0.1 lookup 201
ip rule add pref 11 iif lo from 10.99.0.1 to 10.99.0.2 lookup 202
ip rule add pref 100 lookup local && ip rule del pref 0 lookup local || fail "ip rule"
# Static neighbours: each end's ARP request names a local address as its sender, which the
# other end (the same kernel) does not answer reliably; rxe's first packets then waited on
# neighbour resolution past its retry budget (RETRY_EXC_ERR on a fresh pair of devices).
ip neigh replace 10.99.0.1 lladdr "$(cat /sys/class/net/wtveth0/address)" dev wtveth1 nud permanent
ip neigh replace 10.99.0.2 lladdr "$(cat /sys/class/net/wtveth1/address)" dev wtveth0 nud permanent
rdma link add rxe0 type rxe netdev wtveth0 || fail "rdma link add rxe0"
rdma link add rxe1 type rxe netdev wtveth1 || fail "rdma link add rxe1"
# The image holds the site-packages; the disk is the only one, /dev/vda.
mount -o ro,noatime /dev/vda "$site" || fail "mount the site-packages image on $site"
ulimit -l unlimited
say "rxe0 on wtveth0 10.99.0.1 ($(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)), rxe1 on wtveth1 10.99.0.2 ($(cat /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null)), accel $accel"

# Debian's pyverbs (python3-pyverbs, built for Python 3.11) seen by the venv, alone: the whole
# dist-packages folder on PYTHONPATH would put Debian's other packages before the venv's.
mkdir -p /tmp/wt-pyverbs && ln -sfn /usr/lib/python3/dist-packages/pyverbs /tmp/wt-pyverbs/pyverbs
export PYTHONPATH=/tmp/wt-pyverbs${PYTHONPATH:+:$PYTHONPATH}
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
# The two hosts, engines' first (tests/markers.py: softroce_hosts).
export WT_SOFTROCE_HOSTS=rxe0:10.99.0.1:wtveth0,rxe1:10.99.0.2:wtveth1
# The process launcher's one setting for slow hosts (weight_transfer.cli.launch): under TCG every
# process starts and runs 10-20x slower than on the host.
if [ "$accel" = tcg ]; then export WT_SLOW_HOST=${WT_SLOW_HOST:-10}; fi
# NIXL's wheel bundles its own rdma-core (libibverbs with the mlx5 provider built in). For any
# other provider it looks in /usr/lib64/libibverbs (a RHEL path, where Debian has nothing), and
# Debian's providers link Debian's libibverbs, which the wheel's copy cannot use. So the guest
# gives it Debian's rxe provider relinked against the wheel's libibverbs (patchelf), in an
# overlay over /usr/lib64 (tests/softroce/run); the host's files are untouched. Without this,
# NIXL's UCX sees no rxe device.
nixl_libs="$site/nixl_cu13.libs"
if [ -d "$nixl_libs" ] && command -v patchelf >/dev/null; then
    wheel_verbs=$(ls "$nixl_libs"/libibverbs-*.so* 2>/dev/null | head -1)
    if [ -n "$wheel_verbs" ]; then
        mkdir -p /usr/lib64/libibverbs
        cp /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so /usr/lib64/libibverbs/
        patchelf --replace-needed libibverbs.so.1 "$(patchelf --print-soname "$wheel_verbs")" \
            --set-rpath "$nixl_libs" /usr/lib64/libibverbs/librxe-rdmav34.so ||
            fail "relink the rxe provider for NIXL's libibverbs"
        say "rxe provider relinked for NIXL's libibverbs ($(basename "$wheel_verbs"))"
    fi
fi
cd "$repo"
"$@"
rc=$?
say "exit $rc"
exit $rc
