//! SQL Server for the tests that need it (SQLSERVER_URL, an ADO.NET connection string;
//! SQLSERVER_DIALECT picks the dialect): a schema of its own per test, dropped at the end.
use std::sync::Arc;
use std::time::Duration;

use throttlehost::config::{
    ConnectionString, Dialect, TransactionMode, TransportConfig, TransportKind,
};
use throttlehost::transport::Transport;
use throttlehost::transport::sqlserver::{SqlServerTransport, int_at, parse_connection_string};
use tokio::net::TcpStream;
use tokio_util::compat::TokioAsyncWriteCompatExt;

pub fn url() -> String {
    std::env::var("SQLSERVER_URL").expect(
        "SQLSERVER_URL must hold an ADO.NET connection string, e.g. \
         Server=tcp:127.0.0.1,1433;User Id=sa;Password=...;TrustServerCertificate=true",
    )
}

/// The dialect under test: SQLSERVER_DIALECT, `sqlserver` when unset.
pub fn dialect() -> Dialect {
    match std::env::var("SQLSERVER_DIALECT").as_deref() {
        Err(_) | Ok("") | Ok("sqlserver") => Dialect::Sqlserver,
        Ok("babelfish") => Dialect::Babelfish,
        Ok(other) => panic!("SQLSERVER_DIALECT must be sqlserver or babelfish, not {other:?}"),
    }
}

pub type Client = tiberius::Client<tokio_util::compat::Compat<TcpStream>>;

/// A plain client for assertions and sabotage.
pub async fn client() -> Client {
    let config = parse_connection_string(&url()).unwrap();
    let tcp = TcpStream::connect(config.get_addr()).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tiberius::Client::connect(config, tcp.compat_write())
        .await
        .unwrap()
}

/// A schema and application name of its own for one test.
pub struct Schema {
    pub name: String,
}

impl Schema {
    pub fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Schema {
            name: format!("th_{}", &id[..16]),
        }
    }

    /// The transport settings of this schema, its connections tagged with its name.
    pub fn transport_config(&self, mode: TransactionMode, pool_size: u32) -> TransportConfig {
        TransportConfig {
            kind: TransportKind::Sqlserver,
            connection_string: ConnectionString::new(format!(
                "{};Application Name={}",
                url().trim_end_matches(';'),
                self.name
            )),
            schema: self.name.clone(),
            pool_size,
            transaction_mode: mode,
            connect_timeout: Duration::from_secs(10),
            dialect: dialect(),
            ..TransportConfig::default()
        }
    }

    pub async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport> {
        Arc::new(
            SqlServerTransport::connect(&self.transport_config(mode, pool_size))
                .await
                .expect("SQL Server at SQLSERVER_URL"),
        )
    }

    pub async fn kill_connections(&self) -> u64 {
        let mut c = client().await;
        let rows = c
            .query("SELECT session_id FROM sys.dm_exec_sessions WHERE program_name = @P1 AND session_id <> @@SPID", &[&self.name.as_str()])
            .await
            .unwrap()
            .into_first_result()
            .await
            .unwrap();
        // smallint on SQL Server, int on Babelfish.
        let ids: Vec<i64> = rows.iter().filter_map(|r| int_at(r, 0)).collect();
        for id in &ids {
            c.simple_query(format!("KILL {id}"))
                .await
                .unwrap()
                .into_results()
                .await
                .unwrap();
        }
        ids.len() as u64
    }

    pub fn table(&self, queue: &str) -> String {
        format!("[{}].[{}]", self.name, queue)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut c = client().await;
                // One statement per table: `SELECT @sql += ...` over many rows keeps only
                // one of them on Babelfish, which left test schemas behind.
                let tables: Vec<String> = match c
                    .query(
                        "SELECT TABLE_NAME FROM INFORMATION_SCHEMA.TABLES WHERE TABLE_SCHEMA = @P1",
                        &[&name.as_str()],
                    )
                    .await
                {
                    Ok(stream) => stream
                        .into_first_result()
                        .await
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
                        .collect(),
                    Err(_) => Vec::new(),
                };
                for table in tables {
                    let drop = format!("DROP TABLE [{name}].[{}]", table.replace(']', "]]"));
                    if let Ok(stream) = c.simple_query(drop).await {
                        let _ = stream.into_results().await;
                    }
                }
                let drop_schema =
                    format!("IF SCHEMA_ID(N'{name}') IS NOT NULL EXEC(N'DROP SCHEMA [{name}]');");
                if let Ok(stream) = c.simple_query(drop_schema).await {
                    let _ = stream.into_results().await;
                }
            });
        })
        .join();
    }
}
