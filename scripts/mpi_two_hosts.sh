#!/usr/bin/env bash
# A model split over two "hosts": two network namespaces of this machine joined by a bridge, each one
# rank of `mpirun --host A,B k3 ... --tp/--ep`, with MPI over TCP only (no shared memory between the
# ranks), started through mpirun's remote-shell launcher (a shell agent that enters the namespace in
# place of ssh). This is the multi-node start-up of docs/multi-gpu.md with the network in between;
# the check is that every output is byte for byte one process's.
#   bash scripts/mpi_two_hosts.sh [BUILD_DIR] [--record FILE]
# Needs root (ip netns, a bridge) and Open MPI (scripts/mpi-deps.txt); exits 77 (skipped) without them.
# ctest runs it as mpi_two_hosts; --record writes docs/data/mpi-two-hosts.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=build
record=""
while (($#)); do
  case "$1" in
    --record) record=$2; shift 2 ;;
    *) build=$1; shift ;;
  esac
done
k3="$(cd "$build" && pwd)/bin/k3"
skip() { echo "mpi_two_hosts: skipped: $*"; exit 77; }
[[ $(id -u) == 0 ]] || skip "needs root for network namespaces"
command -v mpirun >/dev/null || skip "mpirun is absent (bash scripts/install_deps.sh scripts/mpi-deps.txt)"
command -v ip >/dev/null || skip "ip (iproute2) is absent"
[[ -x "$k3" ]] || { echo "mpi_two_hosts: no k3 at $k3" >&2; exit 1; }

# One run at a time (the subnet and names are fixed).
exec 9>/tmp/k3-mpi-two-hosts.lock
flock 9
net=10.199.77
ns1=k3mpi-h1 ns2=k3mpi-h2 br=k3mpibr
work=$(mktemp -d)
cleanup() {
  # (the veths too: one whose namespace outlived a killed run stays behind in the root namespace)
  ip link del k3mpiv1 2>/dev/null || true
  ip link del k3mpiv2 2>/dev/null || true
  ip link del "$br" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
  ip netns del "$ns2" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
ip netns add "$ns1" 2>/dev/null || skip "cannot create network namespaces here"
ip netns add "$ns2"
ip link add "$br" type bridge
ip addr add "$net.1/24" dev "$br"
ip link set "$br" up
i=0
for ns in "$ns1" "$ns2"; do
  i=$((i + 1))
  ip link add "k3mpiv$i" type veth peer name "k3mpiv${i}p"
  ip link set "k3mpiv${i}p" netns "$ns"
  ip link set "k3mpiv$i" master "$br"
  ip link set "k3mpiv$i" up
  ip netns exec "$ns" ip addr add "$net.1$i/24" dev "k3mpiv${i}p"
  ip netns exec "$ns" ip link set "k3mpiv${i}p" up
  ip netns exec "$ns" ip link set lo up
done
# (--mca rtc ^hwloc: Open MPI 4.1.4's daemon sharing its hwloc topology through shared memory crashed
# now and then in hwloc_shmem_topology_write when started this way; the ranks do not need it.)
# mpirun's remote shell: "HOST COMMAND..." runs COMMAND in HOST's namespace.
cat > "$work/rsh" <<AGENT
#!/bin/sh
host=\$1; shift
case "\$host" in $net.11) ns=$ns1;; $net.12) ns=$ns2;; *) echo "rsh: unknown host \$host" >&2; exit 1;; esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
AGENT
chmod +x "$work/rsh"
export PMIX_MCA_gds=hash  # (quiets a harmless "PMIX ERROR ... dstore_base.c" line of PMIx 3 at the end)
mpi=(mpirun --allow-run-as-root --host "$net.11,$net.12" -np 2 --mca plm_rsh_agent "$work/rsh"
     --mca rtc ^hwloc --mca btl tcp,self --mca oob_tcp_if_include "$net.0/24" --mca btl_tcp_if_include "$net.0/24")

# Each rank really is in its own namespace, with its own address.
where=$("${mpi[@]}" sh -c 'echo "$OMPI_COMM_WORLD_RANK $(ip -4 -o addr show scope global | awk "{print \$4}")"' | sort)
echo "mpi_two_hosts: ranks and addresses: $(echo "$where" | tr '\n' ';')"
[[ $(echo "$where" | grep -c "$net.1[12]/24") == 2 ]] || { echo "mpi_two_hosts: the ranks are not in the two namespaces" >&2; exit 1; }

fail=0
check() {  # NAME FILE_ONE FILE_TWO
  if cmp -s "$2" "$3"; then echo "mpi_two_hosts: $1: identical"; else echo "mpi_two_hosts: $1: DIFFERENT" >&2; fail=1; fi
}
tiny="$root/tests/fixtures/tiny" nano="$root/models/k3-nano" ids=3,141,59,26,5,35,89,79,32,38,46,26,43
t0=$(date +%s.%N)
"$k3" logits -m "$tiny" --ids "$ids" -o "$work/one.f32" 2>/dev/null
"${mpi[@]}" "$k3" logits -m "$tiny" --ids "$ids" -o "$work/two.f32" --tp 2 --ep 2 -t 1 2>"$work/err" || { cat "$work/err" >&2; exit 1; }
check "k3 logits tiny TP2 x EP2" "$work/one.f32" "$work/two.f32"
t1=$(date +%s.%N)
"$k3" generate -m "$nano" --ids "$ids" -n 24 --print-ids >"$work/one.ids" 2>/dev/null
"${mpi[@]}" "$k3" generate -m "$nano" --ids "$ids" -n 24 --print-ids --tp 2 --ep 2 -t 1 >"$work/two.ids" 2>"$work/err" || { cat "$work/err" >&2; exit 1; }
check "k3 generate K3-nano TP2 x EP2, 24 greedy ids" "$work/one.ids" "$work/two.ids"
t2=$(date +%s.%N)
echo "mpi_two_hosts: $(head -c 200 "$work/two.ids")"
if [[ -n "$record" ]]; then
  python3 - "$record" "$fail" "$where" "$t0" "$t1" "$t2" "$(git -C "$root" rev-parse --short HEAD)" "$(mpirun --version | head -1)" <<'PY'
import json, sys, datetime, platform
rec, fail, where, t0, t1, t2, commit, mpi = sys.argv[1:]
json.dump({
  "command": "bash scripts/mpi_two_hosts.sh --record " + rec,
  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
  "commit": commit, "mpi": mpi, "machine": platform.node() + " " + platform.machine(),
  "setup": "two network namespaces on one machine, a bridge between them; mpirun --host A,B with a remote-shell "
           "agent entering each namespace; MPI over TCP only (--mca btl tcp,self)",
  "ranks": [l for l in where.splitlines()],
  "checks": {"logits tiny TP2xEP2 byte-identical to one process": fail == "0",
             "generate K3-nano TP2xEP2 24 ids identical to one process": fail == "0"},
  "wall_s": {"logits (one process + two hosts)": round(float(t1) - float(t0), 2),
             "generate (one process + two hosts)": round(float(t2) - float(t1), 2)},
}, open(rec, "w"), indent=2)
PY
fi
exit $fail
