//! `relay`: the floor of one extra process hop. Copies bytes between stdin/stdout and a Unix
//! socket (a `direct-files-server --listen`), with no parsing at all: what any boundary process
//! between a harness and a server costs before it does anything. The benchmark reports the
//! shim + broker's added latency against this relay's.
//!
//! `relay SOCKET RECORD` is the floor of a durable hop: every chunk the server sends is appended
//! to RECORD and fdatasynced before it goes on to stdout, as a boundary that records in `always`
//! mode must make its line durable before the answer leaves. The benchmark sets the `always`
//! sequential round trip against it.
//!
//! std only, two threads, no runtime: the cheapest relay this machine can run.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fn main() {
    if let Err(e) = relay() {
        eprintln!("relay: {e}");
        std::process::exit(1);
    }
}

/// An error that names the path it is about.
fn naming(path: &std::ffi::OsStr) -> impl Fn(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{}: {e}", path.to_string_lossy()))
}

fn relay() -> std::io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: relay SOCKET [RECORD]");
        std::process::exit(2);
    };
    let mut record = match args.next() {
        Some(p) => Some(
            File::options()
                .create(true)
                .append(true)
                .open(&p)
                .map_err(naming(&p))?,
        ),
        None => None,
    };
    let socket = UnixStream::connect(&path).map_err(naming(&path))?;
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
                if let Some(f) = record.as_mut() {
                    f.write_all(&buf[..n])?;
                    f.sync_data()?;
                }
                stdout.write_all(&buf[..n])?;
                stdout.flush()?;
            }
        }
    }
}
