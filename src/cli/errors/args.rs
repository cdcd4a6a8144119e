//! The command line of `throttlehost errors`: its subcommands and how they select messages,
//! turned into the [`Action`] and [`Selection`] the commands run.

use std::path::PathBuf;

use super::{Action, Selection};

/// What selects failed messages (`errors list|retry|delete|export`).
#[derive(Debug, Clone, clap::Args)]
pub struct SelectionArgs {
    /// Message ids (the rows' Id, as `errors list --messages` shows them).
    pub ids: Vec<String>,
    /// Only this group (as `errors list` shows it).
    #[arg(long)]
    pub group: Option<String>,
    /// Only messages that failed in this queue (a name or an NServiceBus address).
    #[arg(long)]
    pub source: Option<String>,
    /// Only messages that failed at or after this time (2026-11-27T10:00:00Z), or this long ago (2h).
    #[arg(long)]
    pub since: Option<String>,
    /// Only messages that failed before this time, or this long ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Every message of the error queue (retry, delete: needed when nothing else selects).
    #[arg(long)]
    pub all: bool,
}

impl From<SelectionArgs> for Selection {
    fn from(a: SelectionArgs) -> Self {
        Selection {
            ids: a.ids,
            group: a.group,
            source: a.source,
            since: a.since,
            until: a.until,
            all: a.all,
        }
    }
}

/// `throttlehost errors ...`.
#[derive(Debug, clap::Subcommand)]
pub enum ErrorsCommand {
    /// The failed messages grouped by cause (exception type, first line, queue), largest
    /// group first; --messages lists the messages instead.
    List {
        #[command(flatten)]
        selection: SelectionArgs,
        /// List messages, not groups.
        #[arg(long)]
        messages: bool,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Skip this many messages (with --messages).
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// Show at most this many messages (with --messages).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// One failed message in full: headers, exception, stack trace, body.
    Show {
        /// Its id.
        id: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send failed messages back to the queue each failed in (or --to), each in the
    /// transaction that removes it from the error queue. Runs on the host at
    /// host.admin_address, paced by its publishing throttling; --direct moves without one.
    Retry {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Send them here instead.
        #[arg(long)]
        to: Option<String>,
        /// Needed for more than one message.
        #[arg(long)]
        yes: bool,
        /// Move them from this process, without a running host: not paced.
        #[arg(long)]
        direct: bool,
        /// The host's admin URL (default: http://<host.admin_address>).
        #[arg(long)]
        url: Option<String>,
    },
    /// Delete failed messages.
    Delete {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Needed for more than one message.
        #[arg(long)]
        yes: bool,
    },
    /// Write failed messages as JSON lines (headers, body in base64, failure).
    Export {
        #[command(flatten)]
        selection: SelectionArgs,
        /// The file; - for standard output.
        #[arg(long, short)]
        out: PathBuf,
    },
    /// Store the messages of an exported file in a queue (headers and bodies as exported).
    Import {
        /// The file.
        file: PathBuf,
        /// The queue.
        #[arg(long)]
        to: String,
    },
}

impl From<ErrorsCommand> for Action {
    fn from(c: ErrorsCommand) -> Self {
        match c {
            ErrorsCommand::List {
                selection,
                messages,
                json,
                offset,
                limit,
            } => Action::List {
                selection: selection.into(),
                messages,
                json,
                offset,
                limit,
            },
            ErrorsCommand::Show { id, json } => Action::Show { id, json },
            ErrorsCommand::Retry {
                selection,
                to,
                yes,
                direct,
                url,
            } => Action::Retry {
                selection: selection.into(),
                to,
                yes,
                direct,
                url,
            },
            ErrorsCommand::Delete { selection, yes } => Action::Delete {
                selection: selection.into(),
                yes,
            },
            ErrorsCommand::Export { selection, out } => Action::Export {
                selection: selection.into(),
                out,
            },
            ErrorsCommand::Import { file, to } => Action::Import { file, to },
        }
    }
}
