//! Capy Flash tray app: the server runs in this process (see [`server`]), the tray menu starts
//! and stops it, copies its endpoint and opens the dashboard (the `ui/` files, talking to the
//! in-process server). Closing the window keeps the tray; Quit (or SIGTERM) stops the server
//! and exits.
//!
//! Options: `--model PATH|demo` (default: `CAPY_MODEL`, else the demo model), `--port N`
//! (default: the dashboard's saved port), `--minimized` (no window at start; autostart uses it).
//! Logs go to the OS log folder (`CAPY_LOG_DIR` overrides).

#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

mod server;

use server::{Options, Server, State};
use std::path::PathBuf;
use std::sync::Arc;
use tauri::image::Image;
use tauri::menu::{CheckMenuItem, Menu, MenuItem, PredefinedMenuItem};
use tauri::tray::TrayIconBuilder;
use tauri::{AppHandle, Manager, RunEvent, WebviewUrl, WebviewWindowBuilder, WindowEvent};
use tauri_plugin_autostart::ManagerExt as _;
use tauri_plugin_clipboard_manager::ClipboardExt as _;

const TRAY: &str = "main";
const ICON_STOPPED: &[u8] = include_bytes!("../../icons/tray-stopped.png");
const ICON_LOADING: &[u8] = include_bytes!("../../icons/tray-loading.png");
const ICON_READY: &[u8] = include_bytes!("../../icons/tray-ready.png");
const ICON_ERROR: &[u8] = include_bytes!("../../icons/tray-error.png");

/// The OS log folder: `~/.local/state/capy-flash/logs` on Linux, the local data folder elsewhere.
fn log_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CAPY_LOG_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    directories::ProjectDirs::from("", "", "capy-flash")
        .map(|d| d.state_dir().unwrap_or(d.data_local_dir()).join("logs"))
        .unwrap_or_else(|| std::env::temp_dir().join("capy-flash-logs"))
}

fn init_logging() -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::prelude::*;
    let dir = log_dir();
    let _ = std::fs::create_dir_all(&dir);
    let (file, guard) = tracing_appender::non_blocking(tracing_appender::rolling::daily(
        &dir,
        "capy-flash-app.log",
    ));
    let filter = tracing_subscriber::EnvFilter::try_from_env("CAPY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(file)
                .with_ansi(false),
        )
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .init();
    tracing::info!("logging to {}", dir.display());
    guard
}

struct Args {
    options: Options,
    minimized: bool,
}

fn parse_args() -> Result<Args, String> {
    let settings =
        capy_server::admin::Settings::load(capy_server::admin::settings_path().as_deref());
    let mut options = Options {
        model: std::env::var("CAPY_MODEL").unwrap_or_else(|_| "demo".into()),
        port: settings.port,
        api_key: settings.api_key,
    };
    let mut minimized = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => options.model = it.next().ok_or("--model needs a folder or \"demo\"")?,
            "--port" => {
                let v = it.next().ok_or("--port needs a number")?;
                options.port = v
                    .parse()
                    .map_err(|_| format!("--port: {v:?} is not a port number"))?;
            }
            "--minimized" => minimized = true,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; expected --model PATH|demo, --port N, --minimized"
                ))
            }
        }
    }
    Ok(Args { options, minimized })
}

fn set_tray(app: &AppHandle, state: &State, endpoint: &str) {
    let Some(tray) = app.tray_by_id(TRAY) else {
        return;
    };
    let bytes = match state {
        State::Stopped => ICON_STOPPED,
        State::Loading => ICON_LOADING,
        State::Ready => ICON_READY,
        State::Error(_) => ICON_ERROR,
    };
    if let Ok(img) = Image::from_bytes(bytes) {
        let _ = tray.set_icon(Some(img));
    }
    let _ = tray.set_tooltip(Some(format!("Capy Flash — {} — {endpoint}", state.label())));
}

/// Shows the dashboard window, creating it the first time (or after it was destroyed).
fn show_dashboard(app: &AppHandle) {
    if let Some(w) = app.get_webview_window("main") {
        let _ = w.show();
        let _ = w.set_focus();
        return;
    }
    let endpoint = app.state::<Arc<Server>>().options.endpoint();
    // app.js talks to window.CAPY_ENDPOINT when the page is not served by the server itself.
    let script = format!(
        "window.CAPY_ENDPOINT = {};",
        serde_json::to_string(&endpoint).unwrap()
    );
    let built = WebviewWindowBuilder::new(app, "main", WebviewUrl::App("index.html".into()))
        .title("Capy Flash")
        .inner_size(1100.0, 900.0)
        .initialization_script(&script)
        .build();
    match built {
        Ok(_) => tracing::info!("dashboard window opened ({endpoint})"),
        Err(e) => tracing::error!("cannot open the dashboard window: {e}"),
    }
}

/// Stops the server, then exits. Off the main thread: the server's last state change updates
/// the tray icon, which runs on the main thread, so the main thread must not wait for it.
fn quit(app: &AppHandle) {
    let app = app.clone();
    std::thread::spawn(move || {
        tracing::info!("quitting: stopping the server");
        app.state::<Arc<Server>>().stop();
        tracing::info!("server stopped");
        app.exit(0);
    });
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("capy-flash-app: {e}");
            std::process::exit(2);
        }
    };
    let _log = init_logging();
    let app = tauri::Builder::default()
        // First: a second launch only brings the running one's dashboard forward.
        .plugin(tauri_plugin_single_instance::init(|app, _argv, _cwd| {
            tracing::info!("second instance started: showing the dashboard");
            show_dashboard(app);
        }))
        .plugin(tauri_plugin_autostart::init(
            tauri_plugin_autostart::MacosLauncher::LaunchAgent,
            Some(vec!["--minimized"]),
        ))
        .plugin(tauri_plugin_clipboard_manager::init())
        .setup(move |app| {
            let handle = app.handle().clone();
            let endpoint = args.options.endpoint();
            let server = Arc::new(Server::new(args.options.clone(), {
                let (handle, endpoint) = (handle.clone(), endpoint.clone());
                move |s| set_tray(&handle, s, &endpoint)
            }));
            app.manage(server.clone());

            let start = MenuItem::with_id(app, "start", "Start server", true, None::<&str>)?;
            let stop = MenuItem::with_id(app, "stop", "Stop server", true, None::<&str>)?;
            let copy = MenuItem::with_id(app, "copy", "Copy endpoint URL", true, None::<&str>)?;
            let open = MenuItem::with_id(app, "open", "Open dashboard", true, None::<&str>)?;
            let autostart_on = app.autolaunch().is_enabled().unwrap_or(false);
            let login = CheckMenuItem::with_id(
                app,
                "autostart",
                "Start at login",
                true,
                autostart_on,
                None::<&str>,
            )?;
            let quit_item = MenuItem::with_id(app, "quit", "Quit", true, None::<&str>)?;
            let sep = PredefinedMenuItem::separator(app)?;
            let sep2 = PredefinedMenuItem::separator(app)?;
            let menu = Menu::with_items(
                app,
                &[&start, &stop, &sep, &copy, &open, &sep2, &login, &quit_item],
            )?;
            TrayIconBuilder::with_id(TRAY)
                .icon(Image::from_bytes(ICON_STOPPED)?)
                .tooltip("Capy Flash")
                .menu(&menu)
                .on_menu_event(move |app, event| {
                    let server = app.state::<Arc<Server>>().inner().clone();
                    match event.id().as_ref() {
                        "start" => server.start(),
                        // Stopping waits for in-flight requests: off the UI thread.
                        "stop" => {
                            std::thread::spawn(move || server.stop());
                        }
                        "copy" => {
                            if let Err(e) = app.clipboard().write_text(server.options.endpoint()) {
                                tracing::error!("cannot copy the endpoint URL: {e}");
                            }
                        }
                        "open" => show_dashboard(app),
                        "autostart" => {
                            let a = app.autolaunch();
                            let on = a.is_enabled().unwrap_or(false);
                            let r = if on { a.disable() } else { a.enable() };
                            match r {
                                Ok(()) => tracing::info!("start at login: {}", !on),
                                Err(e) => tracing::error!("cannot change start at login: {e}"),
                            }
                        }
                        "quit" => quit(app),
                        _ => {}
                    }
                })
                .build(app)?;
            set_tray(&handle, &State::Stopped, &endpoint);
            server.start();
            if !args.minimized {
                show_dashboard(&handle);
            }
            #[cfg(unix)]
            {
                // SIGTERM (logout, a service manager, the tests) quits like the menu's Quit.
                let handle = handle.clone();
                tauri::async_runtime::spawn(async move {
                    use tokio::signal::unix::{signal, SignalKind};
                    if let Ok(mut term) = signal(SignalKind::terminate()) {
                        term.recv().await;
                        tracing::info!("SIGTERM: quitting");
                        quit(&handle);
                    }
                });
            }
            Ok(())
        })
        .on_window_event(|window, event| {
            // Closing the window hides it; the tray (and the server) keep running.
            if let WindowEvent::CloseRequested { api, .. } = event {
                let _ = window.hide();
                api.prevent_close();
            }
        })
        .build(tauri::generate_context!());
    let app = match app {
        Ok(a) => a,
        Err(e) => {
            tracing::error!("cannot start the app: {e}");
            std::process::exit(1);
        }
    };
    app.run(|app, event| match event {
        // No window left is not a reason to quit: the tray stays.
        RunEvent::ExitRequested {
            code: None, api, ..
        } => api.prevent_exit(),
        RunEvent::Exit => {
            let _ = app;
            tracing::info!("bye");
        }
        _ => {}
    });
}
