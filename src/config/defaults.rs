//! `[queue_defaults]`: settings every `[[queues]]` entry takes unless it sets them itself, so a
//! host of a thousand queues is configured by one block and a name per queue.
//!
//! The defaults are merged into each entry in the parsed document, before it is deserialized:
//! a value keeps the place it was written, so an error in a default names the queue it broke
//! and the line of `[queue_defaults]` it came from, and what a queue sets for itself wins
//! key by key (`[queues.concurrency] max = 64` keeps the defaults' model).

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The table's name in the file.
pub(crate) const SECTION: &str = "queue_defaults";

/// Takes `[queue_defaults]` out of `root` and merges it into every `[[queues]]` entry. Returns
/// the defaults, for checking on their own, or None when the file has none.
pub(crate) fn apply<'i>(root: &mut DeTable<'i>) -> Option<Spanned<DeValue<'i>>> {
    let defaults = root.remove(SECTION)?;
    let Some(table) = defaults.get_ref().as_table() else {
        // Not a table: deserializing it alone says so, naming the key.
        return Some(defaults);
    };
    if let Some(queues) = root.get_mut("queues")
        && let DeValue::Array(entries) = queues.get_mut()
    {
        for entry in entries.iter_mut() {
            if let DeValue::Table(queue) = entry.get_mut() {
                merge(queue, table);
            }
        }
    }
    Some(defaults)
}

/// Adds to `into` every key of `from` it does not have; tables present in both are merged the
/// same way. Arrays and values are replaced, not merged: a queue's own `subscribe` list is its
/// whole list.
fn merge<'i>(into: &mut DeTable<'i>, from: &DeTable<'i>) {
    for (key, value) in from.iter() {
        match into.get_mut(key.get_ref().as_ref()) {
            None => {
                into.insert(key.clone(), value.clone());
            }
            Some(own) => {
                if let (DeValue::Table(own), DeValue::Table(default)) =
                    (own.get_mut(), value.get_ref())
                {
                    merge(own, default);
                }
            }
        }
    }
}
