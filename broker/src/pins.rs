//! The pin file of brokered providers: namespace → catalogHash of the upstream's own tool list
//! (`providers pin` writes it; an upstream whose list differs is held back).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::RwLock;

/// The pin file: namespace → catalogHash of the upstream's own tool list.
pub struct Pins {
    pub path: Option<PathBuf>,
    map: RwLock<BTreeMap<String, String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error("cannot read pin file `{path}`: {detail}")]
    Read { path: String, detail: String },
    #[error("no pin file is configured (set `pins = \"pins.toml\"` in the broker config)")]
    NotConfigured,
    #[error("cannot write pin file `{path}`: {detail}")]
    Write { path: String, detail: String },
}

impl Pins {
    /// Reads the pin file, when there is one, checked as the broker's own files are
    /// (`trusted::read_settings`; `admin_group`: the config's).
    pub fn load(path: Option<PathBuf>, admin_group: Option<u32>) -> Result<Self, PinError> {
        let map =
            match &path {
                Some(p) if p.exists() => {
                    let text = crate::trusted::read_settings(p, "pin file", |_| admin_group)
                        .map_err(|e| PinError::Read {
                            path: p.display().to_string(),
                            detail: e.to_string(),
                        })?;
                    let t: BTreeMap<String, String> =
                        toml::from_str(&text).map_err(|e| PinError::Read {
                            path: p.display().to_string(),
                            detail: e.to_string(),
                        })?;
                    t
                }
                _ => BTreeMap::new(),
            };
        Ok(Self {
            path,
            map: RwLock::new(map),
        })
    }

    pub fn get(&self, namespace: &str) -> Option<String> {
        self.map.read().ok()?.get(namespace).cloned()
    }

    /// Writes the given pins (replacing those namespaces) to the pin file.
    pub fn write(
        &self,
        pins: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, PinError> {
        let path = self.path.as_ref().ok_or(PinError::NotConfigured)?;
        let mut map = self.map.write().map_err(|_| PinError::NotConfigured)?;
        map.extend(pins.iter().map(|(k, v)| (k.clone(), v.clone())));
        let mut text = String::from(
            "# SharedOS upstream pins: namespace = catalogHash of the upstream's tools/list.\n# Written by `sharedos-broker providers pin`.\n",
        );
        text.push_str(&toml::to_string(&*map).map_err(|e| PinError::Write {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?);
        sharedos_ipc::private_file::write_private(path, &text, None).map_err(|e| {
            PinError::Write {
                path: path.display().to_string(),
                detail: e.to_string(),
            }
        })?;
        Ok(map.clone())
    }
}
