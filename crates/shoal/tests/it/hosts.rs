//! Hosts for multi-host tests, made on this machine: each host is a Linux network namespace with its own address
//! and, for the processes started in it, its own hostname (a UTS namespace), so Shoal sees separate hosts — ranks on
//! one host share memory, ranks on two talk TCP over a real link. The hosts hang off a bridge in a namespace of
//! their own (nothing of the machine's own network is touched); a link can be given a rate (`tc tbf`) and cut.
//!
//! Needs root and iproute2 (`ip`, `tc`) and util-linux's `unshare`: the test set-up of a fresh machine has them,
//! and a test that cannot make its hosts fails saying why (it never skips silently).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Hosts joined by one switch; dropped, they are deleted (with every link of theirs).
pub struct Hosts {
    tag: String,
    /// Third octet of the hosts' subnet (`10.213.N.0/24`).
    net: usize,
    count: usize,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| panic!("running ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {} failed (multi-host tests need root and iproute2): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Hosts {
    /// `count` hosts, `10.213.N.1`, `10.213.N.2`, …; `rate` (e.g. `"1gbit"`) shapes every host's link to the
    /// switch in both directions.
    pub fn new(count: usize, rate: Option<&str>) -> Hosts {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}{}", std::process::id() % 100_000, n);
        let net = (std::process::id() as usize * 7 + n) % 250 + 1;
        let hosts = Hosts { tag, net, count };
        let sw = hosts.switch();
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        for i in 0..count {
            let ns = hosts.ns(i);
            ip(&["netns", "add", &ns]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            let (a, b) = (format!("h{i}-{}", hosts.tag), format!("s{i}-{}", hosts.tag));
            ip(&["link", "add", &a, "netns", &ns, "type", "veth", "peer", "name", &b, "netns", &sw]);
            ip(&["-n", &ns, "link", "set", &a, "name", "eth0"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", hosts.addr(i)), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &sw, "link", "set", &b, "master", "br0"]);
            ip(&["-n", &sw, "link", "set", &b, "up"]);
            if let Some(rate) = rate {
                // The host's sending side, and the switch's side towards it: both directions of the link.
                let burst = "256kb";
                ip(&[
                    "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst",
                    burst, "latency", "100ms",
                ]);
                ip(&[
                    "netns", "exec", &sw, "tc", "qdisc", "add", "dev", &b, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", "100ms",
                ]);
            }
        }
        hosts
    }

    fn switch(&self) -> String {
        format!("shoal-sw-{}", self.tag)
    }

    /// Links this machine's own network namespace to the switch, at `10.213.N.254` (what the hosts reach a
    /// server on this machine at), and gives that address. The link goes with the switch.
    pub fn link_this_machine(&self) -> String {
        let sw = self.switch();
        let (a, b) = (format!("m-{}", self.tag), format!("sm-{}", self.tag));
        let addr = format!("10.213.{}.254", self.net);
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b, "netns", &sw]);
        ip(&["addr", "add", &format!("{addr}/24"), "dev", &a]);
        ip(&["link", "set", &a, "up"]);
        ip(&["-n", &sw, "link", "set", &b, "master", "br0"]);
        ip(&["-n", &sw, "link", "set", &b, "up"]);
        addr
    }

    /// Host `i`'s network namespace (`ip netns exec` mounts the files of `/etc/netns/<it>/` over `/etc`).
    pub fn ns(&self, i: usize) -> String {
        format!("shoal-h{i}-{}", self.tag)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.213.{}.{}", self.net, i + 1)
    }

    /// Host `i`'s name (what its processes see as their hostname).
    pub fn name(&self, i: usize) -> String {
        format!("host{i}-{}", self.tag)
    }

    /// A command that runs `program` on host `i`: in its network namespace, under its hostname.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i), "unshare", "--uts", "--", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
            .arg(self.name(i))
            .arg(program);
        c
    }

    /// Cuts host `i`'s link: nothing reaches it or leaves it any more.
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.ns(i), "link", "set", "eth0", "down"]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.count {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(i)]).status();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.switch()]).status();
    }
}
