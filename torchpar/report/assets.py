"""The inline stylesheet and script of the HTML report (no network: everything ships in the page)."""

CSS = """
:root{--fg:#1f2328;--muted:#59636e;--border:#d1d9e0;--panel:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;color:var(--fg);background:#fff;font:14px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:24px;margin:0 0 2px}
h2{font-size:18px;margin:36px 0 10px;padding-bottom:6px;border-bottom:1px solid var(--border)}
h3{font-size:14px;margin:18px 0 6px;color:var(--muted);font-weight:600}
.sub{color:var(--muted)}
.note{background:#fff8c5;border:1px solid #e6cf7a;border-radius:6px;padding:6px 12px;margin:8px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:18px 0 6px}
.card{background:var(--panel);border:1px solid var(--border);border-radius:8px;padding:8px 14px;min-width:118px}
.card .k{font-size:11px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.card .v{font-size:18px;font-weight:600;font-variant-numeric:tabular-nums}
.tablewrap{overflow-x:auto}
.tablewrap.scroll{max-height:560px;overflow-y:auto;border:1px solid #eaeef2;border-radius:6px}
.tablewrap.scroll th{position:sticky;top:0;z-index:1}
table.kv{width:auto;min-width:420px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid #eaeef2;white-space:nowrap}
th{background:var(--panel);font-weight:600;font-size:13px}
th.num,td.num{text-align:right}
tbody tr:hover{background:#f6f8fa}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th:hover{background:#eaeef2}
th[aria-sort=ascending]::after{content:" \\25B2";font-size:10px}
th[aria-sort=descending]::after{content:" \\25BC";font-size:10px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:3px;vertical-align:-1px;margin-right:6px}
.swatch.comm,.seg.comm{background:repeating-linear-gradient(45deg,#8c959f 0 4px,#d0d7de 4px 8px)}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12.5px;color:var(--muted);margin:6px 0 10px}
.chip{display:inline-block;min-width:26px;text-align:center;margin-right:3px;padding:0 5px;border-radius:4px;
font:600 11.5px/18px ui-monospace,Menlo,Consolas,monospace;color:#fff;background:#8c959f}
.grid .host{display:flex;align-items:center;gap:6px;margin:6px 0}
.hostlabel{width:60px;font-size:12px;color:var(--muted)}
.device{width:76px;height:52px;border-radius:7px;display:flex;flex-direction:column;align-items:center;
justify-content:center;font-size:11px;line-height:1.3;box-shadow:inset 0 0 0 1px rgba(0,0,0,.08)}
.device b{font-size:13px}
.device.idle{background:#e6e9ed;color:var(--muted)}
.barrow{display:flex;align-items:center;gap:10px;margin:4px 0}
.barlabel{width:90px;font-size:12.5px;color:var(--muted)}
.track{flex:1;display:flex;height:16px;background:#f0f2f4;border-radius:4px;overflow:hidden}
.seg{height:100%}
.barvalue{width:300px;font-size:12.5px;font-variant-numeric:tabular-nums}
svg.chart{width:100%;height:auto;display:block}
svg text{font-family:inherit}
.tick{font-size:11px;fill:#59636e}
.axis{stroke:#8c959f}
.gridline{stroke:#eaeef2}
.lane{fill:#e6e9ed;opacity:.55}
.lanelabel{font-size:12px;fill:#1f2328}
.blklabel{font-size:11px;font-weight:600;pointer-events:none}
footer{margin-top:40px;font-size:12px;color:var(--muted)}
"""

JS = """
(function () {
  function key(cell) {
    var v = cell.getAttribute("data-sort");
    if (v === null) { v = cell.textContent.trim(); }
    var n = Number(v);
    return v !== "" && !isNaN(n) ? n : v;
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.querySelectorAll("th");
    heads.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var ascending = th.getAttribute("aria-sort") !== "ascending";
        heads.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a.cells[col]), y = key(b.cells[col]);
          var c = (typeof x === "number" && typeof y === "number") ? x - y
            : String(x).localeCompare(String(y), undefined, {numeric: true});
          return ascending ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
"""
