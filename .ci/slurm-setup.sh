#!/usr/bin/env bash
# Install and start a one-node SLURM cluster on this machine: Debian's slurm-wlm and munge, a slurm.conf
# written for this host (CPUs and RealMemory from `slurmd -C`), and munged, slurmctld and slurmd started
# directly (no systemd needed). Used by CI (.ci/run) and by tests/test_slurm.py. Needs root. Idempotent:
# a second run with the cluster up only checks it; a changed slurm.conf restarts the daemons.
#
# The cluster: partitions `cpu` (default) and `gpu` on the same node, as profiles/slurm expects, and
# $DFLASH_SLURM_FAKE_GPUS (default 2) GPUs declared as GRES on stand-in device files, so `sbatch --gpus=1` is
# scheduled as on a real GPU cluster (SLURM hands out and counts them, CUDA_VISIBLE_DEVICES is set)
# while the work runs on the CPU. Set it to 0 for a cluster without GPUs.
# Accounting: no slurmdbd; finished jobs stay visible to `squeue --states=all` for MinJobAge (1 h) and
# are recorded one line each in /var/log/slurm/jobcomp.log (jobcomp/filetxt).
#
#   bash .ci/slurm-setup.sh          # install if needed, (re)configure, start, wait for the node
#   bash .ci/slurm-setup.sh --stop   # stop the three daemons this script started
set -euo pipefail

FAKE_GPUS=${DFLASH_SLURM_FAKE_GPUS:-2}
CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
MARK="# Written by dflash-pipeline .ci/slurm-setup.sh"
RUN=/run/slurm
LOG=/var/log/slurm
SPOOL=/var/lib/slurm
FAKE_DEV=/run/dflash-fake-gpus

say() { echo "slurm-setup: $*"; }
die() { echo "slurm-setup: $*" >&2; exit 1; }
running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemon() {  # pidfile: end the daemon this script started, by its pid
    if running "$1"; then
        local pid
        pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    rm -f "$1"
}

[[ $(id -u) -eq 0 ]] || die "needs root (installs packages and starts daemons)"

if [[ ${1:-} == --stop ]]; then
    stop_daemon $RUN/slurmd.pid
    stop_daemon $RUN/slurmctld.pid
    stop_daemon /run/munge/munged.pid
    say "stopped"
    exit 0
fi

# 1. Packages (slurm-wlm brings slurmctld, slurmd and the client commands).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm slurm-client munge >/dev/null
fi

# 2. munge: a key, and munged running as the munge user.
if [[ ! -s /etc/munge/munge.key ]]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer"
fi

# 3. slurm.conf for this host. The node line comes from slurmd -C (CPUs, sockets, cores, RealMemory).
NODE=$(hostname -s)
NODE_HW=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //')
[[ $NODE_HW == *CPUs=* && $NODE_HW == *RealMemory=* ]] || die "unexpected slurmd -C output: $NODE_HW"
GRES_NODE="" GRES_TYPES=""
if (( FAKE_GPUS > 0 )); then
    GRES_TYPES="GresTypes=gpu"
    GRES_NODE="Gres=gpu:$FAKE_GPUS"
fi
install -d -o slurm -g slurm -m 0755 $RUN $LOG $SPOOL $SPOOL/slurmctld $SPOOL/slurmd
NEW=$(mktemp)
trap 'rm -f "$NEW" "$NEW.gres"' EXIT
cat >"$NEW" <<EOF
$MARK: a one-node test cluster.
ClusterName=dflash-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$SPOOL/slurmctld
SlurmdSpoolDir=$SPOOL/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups needed (containers, CI): plain process tracking, no task containment.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: finished jobs stay in squeue --states=all for MinJobAge, and each is logged to JobCompLoc.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
MinJobAge=3600
# Cores and memory are consumable, GPUs are GRES: jobs are packed as on a real cluster.
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
$GRES_TYPES
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
NodeName=$NODE NodeAddr=127.0.0.1 $NODE_HW $GRES_NODE State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
EOF
: >"$NEW.gres"
if (( FAKE_GPUS > 0 )); then
    # SLURM's gres/gpu needs one device file per GPU: stand-ins with /dev/null's numbers (1:3), so
    # nothing on this machine changes behaviour if a job opens one. SLURM only counts and assigns them.
    install -d -m 0755 $FAKE_DEV
    for ((i = 0; i < FAKE_GPUS; i++)); do
        [[ -c $FAKE_DEV/gpu$i ]] || mknod -m 0666 $FAKE_DEV/gpu$i c 1 3
    done
    printf '%s\nNodeName=%s Name=gpu File=%s/gpu[0-%d]\n' "$MARK" "$NODE" $FAKE_DEV $((FAKE_GPUS - 1)) >"$NEW.gres"
fi

if [[ -e $CONF ]] && ! head -1 "$CONF" | grep -qF "$MARK"; then
    die "$CONF exists and was not written by this script; not touching it"
fi
changed=0
cmp -s "$NEW" "$CONF" 2>/dev/null || changed=1
cmp -s "$NEW.gres" "$GRES_CONF" 2>/dev/null || changed=1
if (( changed )); then
    say "writing $CONF for node $NODE ($NODE_HW${GRES_NODE:+ $GRES_NODE})"
    install -m 0644 "$NEW" "$CONF"
    if [[ -s $NEW.gres ]]; then install -m 0644 "$NEW.gres" "$GRES_CONF"; else rm -f "$GRES_CONF"; fi
    stop_daemon $RUN/slurmd.pid
    stop_daemon $RUN/slurmctld.pid
fi

# 4. Daemons (they fork into the background themselves).
for daemon in slurmctld slurmd; do
    if ! running $RUN/$daemon.pid; then
        say "starting $daemon"
        /usr/sbin/$daemon
        for _ in $(seq 50); do running $RUN/$daemon.pid && break; sleep 0.1; done
        running $RUN/$daemon.pid || { tail -n 5 $LOG/$daemon.log >&2; die "$daemon did not start (see $LOG/$daemon.log)"; }
    fi
done

# 5. Wait (60 s at most) until the node takes jobs.
state=""
deadline=$((SECONDS + 60))
while ((SECONDS < deadline)); do
    running $RUN/slurmctld.pid || break
    state=$(timeout 10 sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1 || true)
    case $state in
        idle | mix | alloc) break ;;
        down* | drain* | drng* | inval*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
done
case $state in
    idle | mix | alloc) ;;
    *) tail -n 5 $LOG/slurmctld.log $LOG/slurmd.log >&2 || true
       die "node $NODE is not ready (state: '${state:-no answer}')" ;;
esac
say "cluster up: $(sinfo -h -o '%P %D %t %c cpus %m MB %G' | tr '\n' ';')"
