//! `strategy = "ps"`: synchronous parameter servers give data parallelism's parameters and optimizer state, to
//! rounding — over one server and over two, with AdamW and gradient accumulation; the servers are real ones on
//! loopback sockets, the workers threads of this process.

use std::net::TcpListener;
use std::time::Duration;

use shoal_ps::Mode;
use shoal_ps::net::{Server, ServerConfig};

use crate::equivalence::{ADAMW, Run, assert_close, train_world_from};

pub(crate) const SECRET: &[u8] = b"parameter-server-test-secret-32b";

/// Starts `servers` servers for `workers` workers; returns where they listen and their threads.
fn servers(
    servers: usize,
    workers: usize,
    mode: Mode,
) -> (Vec<String>, Vec<std::thread::JoinHandle<shoal_ps::Result<shoal_ps::net::ServeReport>>>) {
    (0..servers)
        .map(|index| {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
            let addr = listener.local_addr().expect("its address").to_string();
            let cfg = ServerConfig {
                index,
                servers,
                workers,
                mode,
                optim: ADAMW,
                rule: shoal_ps::Rule::Mean,
                f: 0,
                wait: Duration::from_secs(60),
                secret: SECRET.to_vec(),
                attack: None,
            };
            let server = Server::new(listener, cfg, None).expect("server");
            (addr, std::thread::spawn(move || server.run()))
        })
        .unzip()
}

#[test]
fn synchronous_parameter_servers_match_data_parallelism() {
    let base = Run { clip: false, ..Run::mlp(30, 60, 2) };
    let ddp = train_world_from(base.clone(), 3, None);
    for count in [1, 2] {
        let (addresses, threads) = servers(count, 3, Mode::Sync);
        let ps = train_world_from(Run { ps: Some((addresses, Mode::Sync)), ..base.clone() }, 3, None);
        for t in threads {
            let report = t.join().expect("server thread").expect("server");
            assert_eq!(report.version, 30, "one update a step");
        }
        let what = format!("ps with {count} server(s) against ddp, 3 workers");
        assert_close(&ddp.params, &ps.params, &what);
        assert_close(&ddp.optimizer, &ps.optimizer, &format!("{what}: optimizer state"));
        assert_eq!(ps.t, 30);
    }
}
