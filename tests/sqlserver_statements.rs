//! The SQL Server statements, as text, for both dialects (snapshot tests: review changes with
//! `cargo insta review`, or `INSTA_UPDATE=always cargo test` and read the diff). They need no
//! server: they pin down what would be sent, so a change to the wire behaviour is a visible,
//! reviewed change.

use throttlehost::config::Dialect;
use throttlehost::transport::QueueName;
use throttlehost::transport::sqlserver::QueueStatements;
use throttlehost::transport::sqlserver::statements::{
    HEADERS_TYPE, IS_BABELFISH, LIST_QUEUES, ROWVERSION_INDEXES, begin_and_receive_batch,
};

fn statements(dialect: Dialect) -> QueueStatements {
    QueueStatements::new("dbo", &QueueName::new("Sales.Node-1").unwrap(), dialect)
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
