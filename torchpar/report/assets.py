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
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:16px 0 6px}
.card{background:var(--panel);border:1px solid var(--border);border-radius:8px;padding:6px 12px;min-width:96px}
.card .k{font-size:11px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.card .v{font-size:16px;font-weight:600;font-variant-numeric:tabular-nums;white-space:nowrap}
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
nav.toc{display:flex;flex-wrap:wrap;gap:4px 14px;margin:10px 0 0;font-size:12.5px}
nav.toc a{color:#0969da;text-decoration:none}
nav.toc a:hover{text-decoration:underline}
.how{background:#ddf4ff;border:1px solid #b6e3ff;border-radius:6px;padding:6px 12px;margin:8px 0;font-size:13px}
.how a{color:#0969da}
.verdict{font-weight:600;margin:8px 0 2px}
.bad{color:#cf222e}
.small{font-size:11.5px}
tr.chosen td{background:#dafbe1}
tr.batchsplit td:nth-child(4){background:#ddf4ff}
.chip.batch{box-shadow:0 0 0 2px #fff,0 0 0 3.5px #1f2328}
.chips{white-space:nowrap}
.operand{display:inline-block;margin:0 10px 2px 0;white-space:nowrap}
.badge{display:inline-block;margin-top:2px;padding:0 6px;border-radius:9px;font-size:11px;background:#fff1e5;
color:#953800;border:1px solid #ffd8b5;white-space:nowrap}
.minibar{width:110px;height:10px;background:#f0f2f4;border-radius:3px;overflow:hidden}
.minibar div{height:100%;background:#57606a}
tr.chosen .minibar div{background:#1a7f37}
ol.stagelist{margin:0;padding-left:18px;font-size:12.5px}
ol.stagelist li{white-space:nowrap}
.track.rel{position:relative;overflow:visible}
.marker{position:absolute;top:-3px;bottom:-3px;width:0;border-left:2px solid #cf222e}
.swatch.markerswatch{background:none;border-left:2px solid #cf222e;border-radius:0;width:4px}
.swatch.dashed{background:none;border-left:2px dashed #cf222e;border-radius:0;width:4px}
.estline{stroke:#cf222e;stroke-width:1.5;stroke-dasharray:5 3}
.estlabel{font-size:11px;fill:#cf222e;font-weight:600}
th.group{text-align:center;border-bottom:1px solid var(--border);font-size:11.5px;text-transform:uppercase;
letter-spacing:.05em;color:var(--muted)}
th.measured,th.group.measured{background:#fff8c5}
table.stages th,table.stages td{white-space:normal;padding:5px 8px}
table.stages td.num{white-space:nowrap}
tfoot tr.total td{border-top:2px solid var(--border);border-bottom:none;background:var(--panel)}
table.strategies td,table.runners td,table.layers td{white-space:normal;vertical-align:top}
table.strategies{table-layout:fixed}
table.strategies th:nth-child(1){width:13%}table.strategies th:nth-child(2){width:24%}
table.strategies th:nth-child(3){width:20%}table.strategies th:nth-child(4){width:13%}
code.module{overflow-wrap:anywhere}
.box{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:4px 24px;background:var(--panel);
border:1px solid var(--border);border-radius:8px;padding:10px 14px}
.kvrow{display:flex;justify-content:space-between;gap:12px;border-bottom:1px dotted var(--border);padding:2px 0}
.kvrow .k{color:var(--muted)}
.kvrow .v{font-variant-numeric:tabular-nums;text-align:right}
details.stageops{margin:10px 0}
details.stageops summary{cursor:pointer;font-weight:600;margin-bottom:6px}
.batchnote{font-size:13px;margin:4px 0 8px}
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
