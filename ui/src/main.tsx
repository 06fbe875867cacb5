// The dsec console (docs/console.md): a login gate, a nav bar and hash
// routes. Served at /ui by the platform; talks to /v1 with the user's key.
import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./styles.css";

import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { clearLogin, onUnauthorized, saveLogin, storedKey, storedWho, type WhoAmI } from "./api";
import { href, useRoute } from "./hooks";
import { Images } from "./pages/Images";
import { Login } from "./pages/Login";
import { Nodes } from "./pages/Nodes";
import { Rates } from "./pages/Rates";
import { Sandbox } from "./pages/Sandbox";
import { Sandboxes } from "./pages/Sandboxes";
import { Trajectories, Trajectory } from "./pages/Trajectories";
import { fetchRates, stopSampler } from "./rates";

const NAV: [string, string, boolean][] = [
  ["sandboxes", "Sandboxes", false],
  ["trajectories", "Trajectories", false],
  ["images", "Images", false],
  ["nodes", "Nodes", true],
  ["rates", "Rates", true],
];

function App() {
  const route = useRoute();
  const [who, setWho] = useState<WhoAmI | null>(storedKey() ? storedWho() : null);
  const [why, setWhy] = useState("");

  useEffect(() => {
    onUnauthorized((msg) => {
      clearLogin();
      stopSampler();
      setWhy("Signed out: the platform refused the key (" + msg + ").");
      setWho(null);
    });
  }, []);
  useEffect(() => {
    // Admins: without a platform history the rates charts fill from the
    // moment of login (fetchRates starts this tab's sampler if it must).
    if (who?.role === "admin") fetchRates().catch(() => {});
  }, [who?.role]);

  if (!who) {
    return (
      <Login
        message={why}
        onLogin={(key, w) => {
          saveLogin(key, w);
          setWhy("");
          setWho(w);
          if (!location.hash || location.hash === "#/" || location.hash === "#") location.hash = href(["sandboxes"]);
        }}
      />
    );
  }

  const logout = () => {
    clearLogin();
    stopSampler();
    setWho(null);
    location.hash = "";
  };

  const page = route.parts[0] || "sandboxes";
  let body;
  if (page === "sandboxes" && route.parts[1]) body = <Sandbox route={route} />;
  else if (page === "sandboxes") body = <Sandboxes route={route} who={who} />;
  else if (page === "trajectories" && route.parts[1]) body = <Trajectory route={route} />;
  else if (page === "trajectories") body = <Trajectories />;
  else if (page === "images") body = <Images />;
  else if (page === "nodes") body = <Nodes />;
  else if (page === "rates") body = <Rates />;
  else
    body = (
      <div class="page">
        <h1>Not found</h1>
        <p>
          No page here. <a href={href(["sandboxes"])}>Sandboxes</a>
        </p>
      </div>
    );

  return (
    <div class="app">
      <header class="topbar">
        <a class="logo" href={href(["sandboxes"])}>
          dsec
        </a>
        <nav>
          {NAV.map(([id, title, admin]) => (
            <a
              href={href([id])}
              class={page === id ? "active" : ""}
              data-testid={"nav-" + id}
              title={admin && who.role !== "admin" ? "needs the admin role" : ""}
            >
              {title}
              {admin && who.role !== "admin" ? <span class="lock"> (admin)</span> : null}
            </a>
          ))}
        </nav>
        <span class="spacer" />
        <span class="who" data-testid="whoami">
          {who.tenant} <span class={"role role-" + who.role}>{who.role}</span>
        </span>
        <button class="btn small ghost" onClick={logout} data-testid="logout">
          Sign out
        </button>
      </header>
      <main>{body}</main>
      <footer class="muted small">
        dsec console · <a href="/ui/licenses.txt">licenses</a>
      </footer>
    </div>
  );
}

render(<App />, document.getElementById("app")!);
