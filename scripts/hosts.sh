# Hosts on this machine for the measurement scripts (sourced, not run): N network namespaces, each with its own
# address ($NET.1, $NET.2, …) and, through `on_host`, its own hostname, joined through a bridge (in a namespace of
# its own) by links shaped to RATE_MBIT Mbit/s each way with `tc tbf`. Needs root and iproute2; `on_host` needs
# util-linux (`unshare`).
#
#   hosts_up TAG NET RATE_MBIT N   makes namespaces shoal-TAG-h0 … shoal-TAG-h(N-1) and shoal-TAG-sw
#   on_host TAG I NAME CMD…        runs CMD in host I, its hostname NAME
#   hosts_down TAG N               removes them (nothing to remove is fine)
#
# TAG must be short (it ends the links' names, at most 15 characters).

hosts_up() {
    local tag=$1 net=$2 rate=$3 n=$4 sw="shoal-$1-sw" i ns
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((i = 0; i < n; i++)); do
        ns=shoal-$tag-h$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "h$i-$tag" netns "$ns" type veth peer name "s$i-$tag" netns "$sw"
        ip -n "$ns" link set "h$i-$tag" name eth0
        ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$sw" link set "s$i-$tag" master br0
        ip -n "$sw" link set "s$i-$tag" up
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "${rate}mbit" burst 256kb latency 100ms
        ip netns exec "$sw" tc qdisc add dev "s$i-$tag" root tbf rate "${rate}mbit" burst 256kb latency 100ms
    done
}

on_host() {
    local tag=$1 i=$2 name=$3
    shift 3
    ip netns exec "shoal-$tag-h$i" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
}

hosts_down() {
    local tag=$1 n=$2 i
    for ((i = 0; i < n; i++)); do ip netns del "shoal-$tag-h$i" 2>/dev/null || true; done
    ip netns del "shoal-$tag-sw" 2>/dev/null || true
}
