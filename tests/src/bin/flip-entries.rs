//! An attacker with a shell in a served folder: swaps entries while the broker works.
//!
//! `flip-entries SECONDS DIR A B [B2 ...]` exchanges `DIR/A` with each `DIR/B…` in turn
//! (`renameat2(RENAME_EXCHANGE)`, atomic: both names always exist) until SECONDS pass.
//! `flip-entries SECONDS DIR --toggle NAME TARGET` makes `DIR/NAME` a symbolic link to TARGET and
//! removes it again, over and over (whatever is at NAME when it removes it, file or link).
//! Prints the number of swaps on stdout at the end.
#![allow(
    clippy::expect_used,
    reason = "a test helper: failing loudly is the point"
)]

use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [seconds, dir, rest @ ..] = args.as_slice() else {
        eprintln!(
            "usage: flip-entries SECONDS DIR A B [B2 ...] | SECONDS DIR --toggle NAME TARGET"
        );
        std::process::exit(2);
    };
    let seconds: f64 = seconds.parse().expect("SECONDS is a number");
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let dir = std::fs::File::open(dir).expect("DIR opens");
    let mut swaps = 0u64;
    match rest {
        [flag, name, target] if flag == "--toggle" => {
            while Instant::now() < until {
                if rustix::fs::symlinkat(target.as_str(), &dir, name.as_str()).is_ok() {
                    swaps += 1;
                }
                let _ = rustix::fs::unlinkat(&dir, name.as_str(), rustix::fs::AtFlags::empty());
            }
        }
        [a, others @ ..] if !others.is_empty() => {
            while Instant::now() < until {
                for b in others {
                    if rustix::fs::renameat_with(
                        &dir,
                        a.as_str(),
                        &dir,
                        b.as_str(),
                        rustix::fs::RenameFlags::EXCHANGE,
                    )
                    .is_ok()
                    {
                        swaps += 1;
                    }
                }
            }
        }
        _ => {
            eprintln!(
                "usage: flip-entries SECONDS DIR A B [B2 ...] | SECONDS DIR --toggle NAME TARGET"
            );
            std::process::exit(2);
        }
    }
    println!("{swaps}");
}
