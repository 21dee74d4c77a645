//! A runtime dir planted by another uid, and folders of the same shape with links in them
//! (issue 31, item 1): the real `sharedos-broker serve` refuses them, naming what it refused,
//! before it makes, reads or writes anything there. Every file a link points at is byte for
//! byte and mode for mode what it was, and nothing is made: a full listing of the test's folder
//! (kind, mode, owner, size, SHA-256 or link target of every entry) is the same before and after.
//!
//! Needs root (CI runs as root): the planting uid is one with no `/etc/passwd` entry, set with
//! `setpriv` (see `deploy`).

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::deploy::{HARNESS_GID, HARNESS_UID, as_uid, need_root};
use crate::kit::{WAIT, bin};

/// Every entry under `root`, links not followed: path → kind, mode, owner, size and SHA-256 (a
/// file) or target (a link).
fn listing(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).expect("ls") {
            let path = entry.expect("entry").path();
            let m = std::fs::symlink_metadata(&path).expect("lstat");
            let what = if m.file_type().is_symlink() {
                format!(
                    "link -> {}",
                    std::fs::read_link(&path).expect("readlink").display()
                )
            } else if m.is_dir() {
                todo.push(path.clone());
                "folder".to_owned()
            } else {
                let bytes = std::fs::read(&path).expect("read");
                format!("file sha256 {:x}", Sha256::digest(&bytes))
            };
            out.insert(
                path,
                format!(
                    "{what} mode {:04o} uid {} gid {} size {}",
                    m.mode() & 0o7777,
                    m.uid(),
                    m.gid(),
                    m.len()
                ),
            );
        }
    }
    out
}

/// Runs `sharedos-broker serve` with `args` (as root, the default runtime dir variables unset);
/// it must stop by itself. Its exit code and stderr.
async fn serve(args: &[&str]) -> (i32, String) {
    let mut cmd = tokio::process::Command::new(bin("sharedos-broker"));
    cmd.arg("serve")
        .args(args)
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("SHAREDOS_RUNTIME_DIR")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("serve refused and stopped in time (it must not serve a planted folder)")
        .expect("run");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The victim's files: a file a link will name as the `.pub`, a newline-free secret a link will
/// name as the record, and a path that does not exist yet (a link will name it as a seed file).
struct Victim {
    file: PathBuf,
    secret: PathBuf,
    absent: PathBuf,
}

fn victim(top: &Path) -> Victim {
    let dir = top.join("victim");
    std::fs::create_dir(&dir).expect("mkdir");
    let v = Victim {
        file: dir.join("notes.txt"),
        secret: dir.join("secret.txt"),
        absent: dir.join("made-through-a-link.txt"),
    };
    std::fs::write(&v.file, "the victim's notes\n").expect("w");
    std::fs::set_permissions(&v.file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    std::fs::write(&v.secret, "SECRET-WITHOUT-NEWLINE").expect("w");
    std::fs::set_permissions(&v.secret, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    v
}

/// Another uid creates the runtime dir first and plants, in `default/`, links to the victim's
/// files, a `.torn` file of its own and a link as the public seed file: `serve` refuses the
/// runtime dir naming its owner, and touches none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn a_runtime_dir_another_uid_planted_is_refused_untouched() {
    if !need_root("a_runtime_dir_another_uid_planted_is_refused_untouched") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let top = tmp.path().to_path_buf();
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let v = victim(&top);
    // The attacker's own folder, where it makes the runtime dir the broker will be given.
    let theirs = top.join("theirs");
    std::fs::create_dir(&theirs).expect("mkdir");
    rustix::fs::chown(
        &theirs,
        Some(rustix::fs::Uid::from_raw(HARNESS_UID)),
        Some(rustix::fs::Gid::from_raw(HARNESS_GID)),
    )
    .expect("chown");
    let rt = theirs.join("rt");
    let plant = format!(
        "set -e; umask 022; mkdir -p '{d}/data/public' '{d}/data/private'; \
         ln -s '{pubf}' '{d}/record.jsonl.key.pub'; ln -s '{secret}' '{d}/record.jsonl'; \
         printf 'torn' > '{d}/record.jsonl.torn'; ln -s '{absent}' '{d}/data/public/hello.txt'",
        d = rt.join("default").display(),
        pubf = v.file.display(),
        secret = v.secret.display(),
        absent = v.absent.display(),
    );
    let mut planter = as_uid(HARNESS_UID, HARNESS_GID, Path::new("/bin/sh"));
    planter.args(["-c", &plant]);
    let status = planter.status().await.expect("plant");
    assert!(status.success());
    assert_eq!(
        std::fs::metadata(&rt).expect("planted").uid(),
        HARNESS_UID,
        "planted by the other uid"
    );
    let before = listing(&top);
    assert_eq!(before.len(), 13, "{before:#?}");
    let (code, err) = serve(&["--runtime-dir", &rt.display().to_string()]).await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains(&format!("`{}`", rt.display())) && err.contains(&format!("uid {HARNESS_UID}")),
        "{err}"
    );
    assert_eq!(listing(&top), before, "{err}");
    assert_eq!(
        std::fs::read(&v.secret).expect("r"),
        b"SECRET-WITHOUT-NEWLINE"
    );
    // In a shared sticky folder (as /tmp), the other uid names the runtime dir with a link to a
    // folder of the broker's uid: the link is another uid's, so it is not followed.
    let shared = top.join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let ours = top.join("ours");
    std::fs::create_dir(&ours).expect("mkdir");
    std::fs::set_permissions(&ours, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let linked = shared.join("rt");
    let mut planter = as_uid(HARNESS_UID, HARNESS_GID, Path::new("/bin/ln"));
    planter.arg("-s").arg(&ours).arg(&linked);
    assert!(planter.status().await.expect("ln").success());
    let before = listing(&top);
    let (code, err) = serve(&["--runtime-dir", &linked.display().to_string()]).await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains(&format!("`{}`", linked.display()))
            && err.contains(&format!("link of uid {HARNESS_UID}")),
        "{err}"
    );
    assert_eq!(listing(&top), before, "{err}");
    assert_eq!(std::fs::read_dir(&ours).expect("ls").count(), 0);
    // The same planting reached through --config: the record and its key in the other uid's
    // folder are refused, naming it, and nothing is made there (the runtime dir is the broker's).
    let mine = top.join("mine");
    std::fs::create_dir(&mine).expect("mkdir");
    std::fs::create_dir(mine.join("rt")).expect("mkdir");
    std::fs::create_dir(mine.join("data")).expect("mkdir");
    std::fs::write(mine.join("policy.cedar"), "").expect("w");
    let d = rt.join("default");
    std::fs::write(
        mine.join("broker.toml"),
        format!(
            "record = \"{}\"\npolicy = \"policy.cedar\"\n[[providers]]\ntype = \"files\"\nroot = \"data\"\n",
            d.join("record.jsonl").display()
        ),
    )
    .expect("w");
    let before = listing(&top);
    let config = mine.join("broker.toml").display().to_string();
    let runtime = mine.join("rt").display().to_string();
    let (code, err) = serve(&["--config", &config, "--runtime-dir", &runtime]).await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains(&format!("`{}`", d.display())) && err.contains(&format!("uid {HARNESS_UID}")),
        "{err}"
    );
    assert_eq!(listing(&top), before, "{err}");
}

/// Folders of the broker's own uid (root here) with one planted name each: the link or the other
/// uid's file is refused by name, with or without --config, and nothing is touched or made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (files of other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn links_in_the_brokers_own_folders_are_refused_by_name() {
    if !need_root("links_in_the_brokers_own_folders_are_refused_by_name") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let top = tmp.path().to_path_buf();
    let v = victim(&top);
    // (what is planted, relative to `default/`) → how.
    enum Plant {
        LinkTo(PathBuf),
        TheirFile,
    }
    let cases = [
        ("data/public/hello.txt", Plant::LinkTo(v.absent.clone())),
        ("data/private/secret.txt", Plant::LinkTo(v.file.clone())),
        ("policy.cedar", Plant::TheirFile),
        ("record.jsonl.key.pub", Plant::LinkTo(v.file.clone())),
        ("record.jsonl.key", Plant::LinkTo(v.file.clone())),
        ("record.jsonl", Plant::LinkTo(v.secret.clone())),
        ("record.jsonl.torn", Plant::TheirFile),
        ("record.jsonl.torn", Plant::LinkTo(v.file.clone())),
        ("record.jsonl.4", Plant::LinkTo(v.secret.clone())),
        ("data", Plant::LinkTo(top.join("victim"))),
    ];
    let mut refused = 0;
    for (i, (name, plant)) in cases.iter().enumerate() {
        for with_config in [false, true] {
            if with_config && (name.starts_with("data") || *name == "policy.cedar") {
                continue; // the embedded layout's own files
            }
            let rt = top.join(format!("rt{i}-{with_config}"));
            let d = rt.join("default");
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o700)).expect("chmod");
            // For a planted name of the embedded layout's, the layout serve makes is made
            // already, so that a refusal makes nothing new; the record's and key's names are
            // checked before the layout is made, so there nothing at all is laid out.
            if name.starts_with("data") || *name == "policy.cedar" {
                std::fs::create_dir_all(d.join("data/public")).expect("mkdir");
                std::fs::create_dir_all(d.join("data/private")).expect("mkdir");
                for (f, text) in [
                    ("data/public/hello.txt", "hello\n"),
                    ("data/private/secret.txt", "secret\n"),
                    ("policy.cedar", ""),
                ] {
                    std::fs::write(d.join(f), text).expect("w");
                }
            }
            let at = d.join(name);
            if at.is_dir() {
                std::fs::remove_dir_all(&at).expect("rm");
            } else if at.exists() {
                std::fs::remove_file(&at).expect("rm");
            }
            match plant {
                Plant::LinkTo(target) => std::os::unix::fs::symlink(target, &at).expect("ln"),
                Plant::TheirFile => {
                    std::fs::write(&at, "theirs").expect("w");
                    rustix::fs::chown(&at, Some(rustix::fs::Uid::from_raw(HARNESS_UID)), None)
                        .expect("chown");
                }
            }
            let before = listing(&top);
            let runtime = rt.display().to_string();
            let config = d.join("broker.toml");
            let (code, err) = if with_config {
                std::fs::write(
                    &config,
                    "record = \"record.jsonl\"\npolicy = \"policy.cedar\"\n[[providers]]\ntype = \"files\"\nroot = \"data\"\n",
                )
                .expect("w");
                let config = config.display().to_string();
                let before = listing(&top);
                let out = serve(&["--config", &config, "--runtime-dir", &runtime]).await;
                assert_eq!(listing(&top), before, "{name} with --config: {}", out.1);
                out
            } else {
                let out = serve(&["--runtime-dir", &runtime]).await;
                assert_eq!(listing(&top), before, "{name}: {}", out.1);
                out
            };
            assert_ne!(code, 0, "{name}: {err}");
            let why = match plant {
                Plant::LinkTo(_) => "link".to_owned(),
                Plant::TheirFile => format!("uid {HARNESS_UID}"),
            };
            assert!(
                err.contains(&format!("`{}`", at.display())) && err.contains(&why),
                "{name} (config {with_config}): {err}"
            );
            refused += 1;
        }
    }
    assert_eq!(refused, 16);
    assert_eq!(
        std::fs::read(&v.secret).expect("r"),
        b"SECRET-WITHOUT-NEWLINE"
    );
    assert_eq!(
        std::fs::metadata(&v.secret).expect("m").mode() & 0o7777,
        0o640
    );
    assert_eq!(std::fs::read(&v.file).expect("r"), b"the victim's notes\n");
    assert!(!v.absent.exists());
}
