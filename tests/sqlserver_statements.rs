//! The SQL Server statements, as text, for both dialects (snapshot tests: review changes with
//! `cargo insta review`, or `INSTA_UPDATE=always cargo test` and read the diff). They need no
//! server: they pin down what would be sent, so a change to the wire behaviour is a visible,
//! reviewed change.

use throttlehost::config::{Dialect, OrderingConfig};
use throttlehost::transport::QueueName;
use throttlehost::transport::sqlserver::QueueStatements;
use throttlehost::transport::sqlserver::statements::{
    CLAIM_GIVE_UP, HEADERS_TYPE, IS_BABELFISH, LIST_QUEUES, ROWVERSION_INDEXES, SEND_MANY_ROWS,
    babelfish_candidates, babelfish_claim, babelfish_warm_up, begin_and_receive_batch, send_many,
};

fn statements(dialect: Dialect) -> QueueStatements {
    QueueStatements::new(
        "dbo",
        &QueueName::new("Sales.Node-1").unwrap(),
        dialect,
        "Delayed",
    )
}

#[test]
fn sqlserver_dialect() {
    let s = statements(Dialect::Sqlserver);
    insta::assert_snapshot!("create", s.create);
    insta::assert_snapshot!("drop", s.drop);
    insta::assert_snapshot!("send_with_recoverable", s.send_with_recoverable);
    insta::assert_snapshot!("send_without_recoverable", s.send_without_recoverable);
    insta::assert_snapshot!("send_raw_with_recoverable", s.send_raw_with_recoverable);
    insta::assert_snapshot!("has_recoverable", s.has_recoverable);
    insta::assert_snapshot!("receive", s.receive);
    insta::assert_snapshot!("begin_and_receive", s.begin_and_receive);
    insta::assert_snapshot!("commit_and_receive", s.commit_and_receive);
    insta::assert_snapshot!("peek", s.peek);
    insta::assert_snapshot!("purge_expired_batch", s.purge_expired_batch);
    insta::assert_snapshot!("purge", s.purge);
}

/// The batch receive in both dialects (a table variable, ordered at the end).
#[test]
fn delayed_table() {
    let s = statements(Dialect::Sqlserver).delayed;
    insta::assert_snapshot!("delayed_create", s.create);
    insta::assert_snapshot!("delayed_store", s.store);
    insta::assert_snapshot!(
        "delayed_move_due_with_recoverable",
        s.move_due_with_recoverable
    );
    insta::assert_snapshot!(
        "delayed_move_due_without_recoverable",
        s.move_due_without_recoverable
    );
    let b = statements(Dialect::Babelfish).delayed;
    assert_eq!(
        (b.create, b.store),
        (s.create, s.store),
        "one table layout, one store"
    );
    insta::assert_snapshot!("babelfish_delayed_move_due", b.move_due_with_recoverable);
    assert!(
        !b.move_due_with_recoverable.contains("WITH message AS"),
        "Babelfish takes no DML through a CTE"
    );
}

#[test]
fn batch_receive() {
    let s = statements(Dialect::Sqlserver);
    insta::assert_snapshot!(
        "begin_and_receive_batch",
        begin_and_receive_batch(&s.table, 32, Dialect::Sqlserver)
    );
    insta::assert_snapshot!(
        "babelfish_begin_and_receive_batch",
        begin_and_receive_batch(&s.table, 32, Dialect::Babelfish)
    );
}

/// The multi-row insert of bulk sends and of a batch's outbox: ordered by INSERT ... SELECT
/// ... ORDER BY (identity follows it), four parameters a row, within the 2 100 limit.
#[test]
fn multi_row_send() {
    let s = statements(Dialect::Sqlserver);
    insta::assert_snapshot!("send_many_3_with_recoverable", send_many(&s.table, 3, true));
    insta::assert_snapshot!(
        "send_many_2_without_recoverable",
        send_many(&s.table, 2, false)
    );
    let widest = send_many(&s.table, SEND_MANY_ROWS, true);
    let last = 4 * SEND_MANY_ROWS;
    assert!(
        widest.contains(&format!("@P{last})")),
        "every parameter bound"
    );
    assert!(!widest.contains(&format!("@P{}", last + 1)));
    assert!(last <= 2100, "SQL Server takes at most 2 100 parameters");
    assert!(widest.trim_end().ends_with("ORDER BY m.N;"));
}

/// Babelfish's claiming receive: a look-up of the rows to take (a read, past this host's
/// rows), then a delete of exactly the rows handed out, with a lock timeout of 1 ms (never 0,
/// which PostgreSQL reads as "wait for ever") restored before the statement ends, and no CTE,
/// no table variable, no expression over `deleted` (what Babelfish rejects or makes slow).
#[test]
fn babelfish_claim_receive() {
    let s = statements(Dialect::Babelfish);
    let look_up = babelfish_candidates(&s.claim_from, (&[17, 18], 3), 32);
    insta::assert_snapshot!("babelfish_candidates", look_up);
    assert_eq!(
        look_up,
        "SELECT RowVersion FROM [dbo].[Sales.Node-1] WHERE RowVersion NOT IN (17, 18) ORDER BY RowVersion OFFSET 3 ROWS FETCH NEXT 32 ROWS ONLY;"
    );
    assert!(!babelfish_candidates(&s.claim_from, (&[], 0), 8).contains("NOT IN"));
    let claim = babelfish_claim(&s.table, &[41], true);
    insta::assert_snapshot!("babelfish_claim_transactional", claim);
    insta::assert_snapshot!(
        "babelfish_claim_autocommit",
        babelfish_claim(&s.table, &[41], false)
    );
    insta::assert_snapshot!("babelfish_claim_give_up", CLAIM_GIVE_UP);
    // A connection's warm-up is the autocommit claim of a row no queue has.
    let warm_up = babelfish_warm_up(&s.table);
    assert_eq!(warm_up, babelfish_claim(&s.table, &[-1], false));
    assert!(!warm_up.contains("BEGIN TRAN"), "nothing left open");
    assert!(warm_up.contains("\nWHERE RowVersion IN (-1);\n"));
    assert!(claim.starts_with("SET LOCK_TIMEOUT 1;\nBEGIN TRAN;\nDELETE"));
    assert!(claim.contains("\nWHERE RowVersion IN (41);\n"));
    assert!(claim.trim_end().ends_with("SET LOCK_TIMEOUT -1;"));
    assert!(claim.contains("OUTPUT deleted.Id, GETUTCDATE(), deleted.Headers"));
    assert!(!claim.contains("WITH message"));
    assert!(!claim.contains("@received"), "no table variable");
    assert!(!claim.contains("CASE"), "no expression over deleted");
    assert!(!babelfish_claim(&s.table, &[41], false).contains("BEGIN TRAN"));
    // A batch claims the rows handed out to it.
    let batch = babelfish_claim(&s.table, &[17, 18, 20], true);
    insta::assert_snapshot!("babelfish_claim_batch", batch);
    assert!(batch.contains("WHERE RowVersion IN (17, 18, 20);"));
}

#[test]
fn babelfish_dialect() {
    let s = statements(Dialect::Babelfish);
    insta::assert_snapshot!("babelfish_receive", s.receive);
    insta::assert_snapshot!("babelfish_begin_and_receive", s.begin_and_receive);
    insta::assert_snapshot!("babelfish_peek", s.peek);
    // Everything else is shared with SQL Server.
    let sql = statements(Dialect::Sqlserver);
    assert_eq!(s.create, sql.create);
    assert_eq!(s.send_with_recoverable, sql.send_with_recoverable);
    assert_eq!(s.purge_expired_batch, sql.purge_expired_batch);
}

#[test]
fn babelfish_avoids_what_it_rejects() {
    let s = statements(Dialect::Babelfish);
    for statement in [&s.receive, &s.begin_and_receive, &s.commit_and_receive] {
        assert!(
            !statement.contains("WITH message AS"),
            "no DML through a CTE: {statement}"
        );
        assert!(
            !statement.contains("CASE WHEN deleted."),
            "no OUTPUT expression over deleted: {statement}"
        );
    }
}

#[test]
fn the_nservicebus_receive_semantics_are_kept() {
    let s = statements(Dialect::Sqlserver);
    assert!(s.receive.contains("SELECT TOP(1) * FROM [dbo].[Sales.Node-1] WITH (UPDLOCK, READPAST, ROWLOCK) ORDER BY RowVersion"));
    assert!(s.receive.contains("DELETE FROM message"));
    assert!(s.peek.contains("WITH (READPAST, READCOMMITTEDLOCK)"));
    assert!(s.send_with_recoverable.contains("Recoverable, Expires"));
    assert!(
        s.send_with_recoverable.contains("GETUTCDATE()"),
        "expiry from the server's clock"
    );
    assert!(
        s.create
            .contains("CREATE NONCLUSTERED INDEX Index_RowVersion")
    );
    assert!(s.create.contains("WHERE Expires IS NOT NULL"));
    assert!(
        !s.create.contains("CREATE CLUSTERED"),
        "a heap: no clustered index"
    );
    assert!(s.create.contains("sp_getapplock"));
    // Every value is a parameter.
    for statement in [
        &s.send_with_recoverable,
        &s.send_raw_with_recoverable,
        &s.purge_expired_batch,
    ] {
        assert!(statement.contains("@P1"));
    }
}

#[test]
fn catalog_queries() {
    insta::assert_snapshot!("rowversion_indexes", ROWVERSION_INDEXES);
    insta::assert_snapshot!("headers_type", HEADERS_TYPE);
    insta::assert_snapshot!("list_queues", LIST_QUEUES);
    insta::assert_snapshot!("is_babelfish", IS_BABELFISH);
}

/// The ordered receive: a key's rows are deleted only under the key's application lock, the
/// lock is tried without waiting and owned by the transaction, and the receive keeps the
/// NServiceBus hints on the row it deletes.
#[test]
fn ordered_receive() {
    let ordering = OrderingConfig {
        key_header: "NServiceBus.ConversationId".into(),
        ..OrderingConfig::default()
    };
    let s = statements(Dialect::Sqlserver).with_ordering(&ordering);
    assert!(s.ordered);
    insta::assert_snapshot!("ordered_begin_and_receive", s.begin_and_receive);
    assert!(
        s.commit_and_receive
            .starts_with("COMMIT TRAN;\nBEGIN TRAN;\n")
    );
    assert_eq!(
        s.commit_and_receive["COMMIT TRAN;\n".len()..],
        s.begin_and_receive[..],
        "the same receive after the commit"
    );
    let sql = &s.begin_and_receive;
    for part in [
        "SELECT TOP (64) RowVersion",
        "JSON_VALUE(Headers, N'$.\"NServiceBus.ConversationId\"')",
        "@LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0",
        "WITH (UPDLOCK, READPAST, ROWLOCK) WHERE RowVersion = @rv",
        "EXEC sp_releaseapplock",
        "IF NOT EXISTS (SELECT 1 FROM @received) AND @@TRANCOUNT > 0 COMMIT TRAN;",
    ] {
        assert!(sql.contains(part), "missing {part}");
    }
    // The key's lock comes before the key's row is deleted.
    assert!(sql.find("sp_getapplock").unwrap() < sql.find("DELETE FROM message").unwrap());
}

/// Ordered stages: the own stage is locked Shared before the row is deleted; the previous
/// stage's lock is taken Exclusive, without waiting, around the look for its rows and let go
/// at once; with a key as well, the key's lock comes first.
#[test]
fn ordered_receive_with_stages() {
    let stages = OrderingConfig {
        stages: true,
        ..OrderingConfig::default()
    };
    let s = statements(Dialect::Sqlserver).with_ordering(&stages);
    assert!(s.ordered);
    insta::assert_snapshot!("ordered_stages_begin_and_receive", s.begin_and_receive);
    let sql = &s.begin_and_receive;
    assert!(!sql.contains("PARTITION BY"), "no key, no per-key heads");
    let shared = sql.find("@LockMode = 'Shared'").expect("own stage Shared");
    let exclusive = sql
        .find("@LockMode = 'Exclusive'")
        .expect("previous stage Exclusive");
    let look = sql
        .find("WHERE CASE WHEN ISJSON(Headers) = 1 THEN JSON_VALUE(Headers, N'$.\"throttlehost.ExecutionStage\"') END = @previous")
        .expect("the look for rows of the previous stage");
    let release = sql
        .find("EXEC sp_releaseapplock @Resource = @previous_lock")
        .expect("the previous stage's lock let go");
    let delete = sql.find("DELETE FROM message").unwrap();
    assert!(shared < exclusive && exclusive < look && look < release && release < delete);
    for part in [
        "JSON_VALUE(Headers, N'$.\"throttlehost.PreviousStage\"')",
        "@LockOwner = 'Transaction', @LockTimeout = 0",
        "IF @stage_held = 1 EXEC sp_releaseapplock @Resource = @stage_lock",
    ] {
        assert!(sql.contains(part), "missing {part}");
    }
    let both = OrderingConfig {
        key_header: "Sales.OrderId".into(),
        stages: true,
        ..OrderingConfig::default()
    };
    let sql = statements(Dialect::Sqlserver)
        .with_ordering(&both)
        .begin_and_receive;
    assert!(sql.contains("PARTITION BY k"));
    assert!(
        sql.find("@Resource = @key_lock").unwrap() < sql.find("@Resource = @stage_lock").unwrap()
    );
}

/// `failed_key = "hold"`: with the key's lock held, a candidate that holds its key is passed
/// over (the key's lock let go), before anything is deleted.
#[test]
fn ordered_receive_passes_over_a_held_key() {
    let ordering = OrderingConfig {
        key_header: "Sales.OrderId".into(),
        failed_key: throttlehost::config::FailedKey::Hold,
        ..OrderingConfig::default()
    };
    let sql = statements(Dialect::Sqlserver)
        .with_ordering(&ordering)
        .begin_and_receive;
    let check = sql
        .find("FROM [dbo].[throttlehost_held] h JOIN [dbo].[Sales.Node-1] m WITH (READPAST) ON m.Id = h.message_id")
        .expect("the held check");
    assert!(
        sql[check..]
            .contains("WHERE h.queue_table = N'[dbo].[Sales.Node-1]' AND m.RowVersion = @rv")
    );
    assert!(sql.find("@Resource = @key_lock, @LockMode").unwrap() < check);
    assert!(check < sql.find("DELETE FROM message").unwrap());
    let plain = OrderingConfig {
        failed_key: throttlehost::config::FailedKey::Continue,
        ..ordering
    };
    assert!(
        !statements(Dialect::Sqlserver)
            .with_ordering(&plain)
            .begin_and_receive
            .contains("throttlehost_held")
    );
}

/// The Babelfish ordered receive is a claim (a row lock that gives up within 1 ms) over the
/// rows that may run: each key's oldest, unkeyed rows, no held key, no stage whose previous
/// stage has rows. It asks for no application lock: Babelfish 4.2's server process aborts at
/// the fifth refused `sp_getapplock` (or `APPLOCK_TEST` answering 0) of a session.
#[test]
fn babelfish_ordered_receive_claims_from_the_rows_that_may_run() {
    let all = OrderingConfig {
        key_header: "Sales.OrderId".into(),
        stages: true,
        failed_key: throttlehost::config::FailedKey::Hold,
        ..OrderingConfig::default()
    };
    let s = statements(Dialect::Babelfish).with_ordering(&all);
    assert!(s.ordered);
    let look_up = babelfish_candidates(&s.claim_from, (&[7], 2), 32);
    insta::assert_snapshot!("babelfish_ordered_candidates", look_up);
    assert!(look_up.contains("WHERE (h.k IS NULL OR h.nth = 1)"));
    assert!(look_up.contains("[dbo].[throttlehost_held] x"));
    assert!(look_up.contains("h.previous IS NULL OR NOT EXISTS"));
    assert!(look_up.contains(
        "\n  AND h.RowVersion NOT IN (7)\nORDER BY h.RowVersion OFFSET 2 ROWS FETCH NEXT 32 ROWS ONLY;"
    ));
    // The claim takes the row the look-up found may run by name, as on any queue (its text
    // is pinned in `babelfish_claim_receive`).
    for text in [
        &look_up,
        s.waiting.as_ref().unwrap(),
        &s.delayed.move_due_with_recoverable,
        &s.delayed.move_due_without_recoverable,
    ] {
        assert!(!text.contains("applock"), "{text}");
        assert!(!text.contains("APPLOCK"), "{text}");
    }
    // Unordered, the look-up reads every row.
    let plain = statements(Dialect::Babelfish);
    assert!(
        babelfish_candidates(&plain.claim_from, (&[], 0), 32).starts_with(
            "SELECT RowVersion FROM [dbo].[Sales.Node-1] ORDER BY RowVersion OFFSET 0 ROWS"
        )
    );
}

/// An ordered queue's waiting count: later messages of a key, keys whose lock a receive holds
/// (tested, not taken), held keys and unfinished previous stages, over the window's rows.
#[test]
fn ordered_waiting_tests_locks_without_taking_them() {
    let all = OrderingConfig {
        key_header: "Sales.OrderId".into(),
        stages: true,
        failed_key: throttlehost::config::FailedKey::Hold,
        ..OrderingConfig::default()
    };
    let s = statements(Dialect::Sqlserver).with_ordering(&all);
    let sql = s
        .waiting
        .as_deref()
        .expect("an ordered queue counts its waiting messages");
    insta::assert_snapshot!("ordered_waiting", sql);
    assert!(!sql.contains("sp_getapplock"), "a count takes no lock");
    assert!(sql.contains("APPLOCK_TEST('public', N'throttlehost:key:f754755763f32bba:'"));
    assert!(sql.contains("APPLOCK_TEST('public', N'throttlehost:stage:f754755763f32bba:'"));
    assert!(sql.contains("[throttlehost_held]"));
    assert!(sql.contains("SELECT TOP (64) RowVersion"));
    // Without a key, only the stage condition is left.
    let stages = OrderingConfig {
        stages: true,
        ..OrderingConfig::default()
    };
    let only_stages = statements(Dialect::Sqlserver)
        .with_ordering(&stages)
        .waiting
        .unwrap();
    assert!(!only_stages.contains("throttlehost:key:"));
    assert!(only_stages.contains("w.previous IS NOT NULL"));
    assert_eq!(statements(Dialect::Sqlserver).waiting, None, "unordered");
}

/// Every binary-to-text conversion Babelfish gets wrong, in every statement of both dialects
/// and every ordering: `CONVERT` with a binary style (1 or 2) is ignored there (the bytes are
/// decoded as WIN1252 text, which failed the ordered receive for about half of all keys), and
/// a hash is binary.
#[test]
fn no_statement_converts_binary_to_text() {
    let keyed = OrderingConfig {
        key_header: "Order.Key".into(),
        stages: true,
        failed_key: throttlehost::config::FailedKey::Hold,
        ..OrderingConfig::default()
    };
    let mut texts = Vec::new();
    for dialect in [Dialect::Sqlserver, Dialect::Babelfish] {
        for ordering in [None, Some(&keyed)] {
            let s = match ordering {
                Some(o) => statements(dialect).with_ordering(o),
                None => statements(dialect),
            };
            texts.extend([
                s.create.clone(),
                s.receive.clone(),
                s.begin_and_receive.clone(),
                s.commit_and_receive.clone(),
                s.peek.clone(),
                s.still_queued.clone(),
                s.purge_expired_batch.clone(),
                s.waiting.clone().unwrap_or_default(),
                s.delayed.create.clone(),
                s.delayed.store.clone(),
                s.delayed.move_due_with_recoverable.clone(),
                s.delayed.move_due_without_recoverable.clone(),
            ]);
        }
        let plain = statements(dialect);
        let ordered = statements(dialect).with_ordering(&keyed);
        texts.push(babelfish_claim(&plain.table, &[3], true));
        texts.push(babelfish_candidates(&ordered.claim_from, (&[3], 0), 32));
        texts.push(begin_and_receive_batch(&plain.table, 8, dialect));
    }
    for text in &texts {
        assert!(!text.contains("HASHBYTES"), "a hash is binary: {text}");
        assert_eq!(binary_styles(text), Vec::<u32>::new(), "{text}");
    }
    // The check itself finds what it looks for.
    assert_eq!(
        binary_styles("SELECT CONVERT(nvarchar(64), HASHBYTES('SHA2_256', x), 2)"),
        vec![2]
    );
    assert!(binary_styles("SELECT CONVERT(nvarchar(30), held_at, 121)").is_empty());
}

/// The style arguments 1 and 2 (binary to hex text) of the `CONVERT` calls in `sql`.
fn binary_styles(sql: &str) -> Vec<u32> {
    let mut found = Vec::new();
    let mut rest = sql;
    while let Some(at) = rest.find("CONVERT(") {
        rest = &rest[at + "CONVERT(".len()..];
        // The call's arguments: up to the parenthesis that closes it, split at top level.
        let (mut depth, mut args, mut current) = (0, Vec::new(), String::new());
        for c in rest.chars() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => break,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    args.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            current.push(c);
        }
        args.push(current);
        if let [_, _, style] = args.as_slice()
            && let Ok(style) = style.trim().parse::<u32>()
            && (style == 1 || style == 2)
        {
            found.push(style);
        }
    }
    found
}

/// The instance registry's statements, pinned: the table under the schema's creation lock,
/// one heartbeat that updates or inserts (an empty admin address stored as NULL), ages by the
/// server's clock, and counts selected (the session runs with NOCOUNT on).
#[test]
fn instance_registry_statements() {
    let st = throttlehost::transport::sqlserver::fleet::registry_statements("dbo");
    assert_eq!(st.table, "[dbo].[throttlehost_instances]");
    insta::assert_snapshot!("registry_create", st.create);
    insta::assert_snapshot!("registry_heartbeat", st.heartbeat);
    insta::assert_snapshot!("registry_list", st.list);
    insta::assert_snapshot!("registry_forget", st.forget);
    assert!(st.heartbeat.contains("IF @@ROWCOUNT = 0"));
    assert!(st.forget.ends_with("SELECT CAST(@@ROWCOUNT AS bigint);"));
    // DATEDIFF counts in an int: milliseconds only for rows seen within a day.
    assert!(st.list.contains("DATEADD(day, -1, SYSUTCDATETIME())"));
}
