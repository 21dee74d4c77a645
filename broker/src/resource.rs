//! What a call touches, as the policy decides on it: a leaf below the policy engine and the
//! providers, which both use it and neither owns it.

use sharedos_proto::Requirement;

/// The Cedar namespace of every entity type.
pub const NAMESPACE: &str = "SharedOS";

/// A resource a call is decided on, built from the call's canonicalized arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Resource {
    /// A file of one provider's space: `namespace` is the provider's (two providers' `/a` are
    /// two files, and a policy can tell them apart with `resource.namespace`).
    File {
        namespace: String,
        path: String,
    },
    Tool {
        name: String,
    },
}

impl Resource {
    pub fn type_name(&self) -> &'static str {
        match self {
            Resource::File { .. } => "File",
            Resource::Tool { .. } => "Tool",
        }
    }

    pub(crate) fn id(&self) -> &str {
        match self {
            Resource::File { path, .. } => path,
            Resource::Tool { name } => name,
        }
    }

    /// `SharedOS::File::"/public/a.txt"`, for people and records.
    pub fn display(&self) -> String {
        format!("{NAMESPACE}::{}::{:?}", self.type_name(), self.id())
    }

    /// The bare id (`/public/a.txt`), for sentences.
    pub fn short(&self) -> &str {
        self.id()
    }

    /// What a call requires, as answers and record lines carry it: the action, the resource's
    /// [`display`](Self::display) text, and what that text leaves out (a file's namespace).
    pub fn requirement(&self, action: &str) -> Requirement {
        Requirement {
            action: action.to_owned(),
            resource: self.display(),
            namespace: match self {
                Resource::File { namespace, .. } => Some(namespace.clone()),
                Resource::Tool { .. } => None,
            },
        }
    }
}
