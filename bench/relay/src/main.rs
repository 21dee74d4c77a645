//! `relay`: the floor of one extra process hop. Copies bytes between stdin/stdout and a Unix
//! socket (a `direct-files-server --listen`), with no parsing at all: what any boundary process
//! between a harness and a server costs before it does anything. The benchmark reports the
//! shim + broker's added latency against this relay's.
//!
//! std only, two threads, no runtime: the cheapest relay this machine can run.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fn main() -> std::io::Result<()> {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: relay SOCKET");
        std::process::exit(2);
    };
    let socket = UnixStream::connect(&path)?;
    let mut to_server = socket.try_clone()?;
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 65536];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_server.shutdown(std::net::Shutdown::Write);
    });
    // Raw stdout (not the line-buffered handle): every chunk goes out as it arrives.
    let mut from_server = socket;
    let mut stdout = std::io::stdout().lock();
    let mut buf = [0u8; 65536];
    loop {
        match from_server.read(&mut buf) {
            Ok(0) | Err(_) => return Ok(()),
            Ok(n) => {
                stdout.write_all(&buf[..n])?;
                stdout.flush()?;
            }
        }
    }
}
