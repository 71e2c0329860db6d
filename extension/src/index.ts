/**
 * monarch-nb-lab: the active notebook kernel's monarch_nb mesh in JupyterLab.
 *
 * A status-bar item ("mesh 4/4 ranks · cpu", red while a rank is down) and
 * a side panel (ranks with state, incarnation, restarts, heartbeat age;
 * buttons for stacks and restart-rank), fed by the kernel through a comm
 * (connector.ts). What is shown is computed by the pure functions of model.ts.
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { Connector } from './connector';
import { COLUMNS, COLUMN_TITLES, canRestart, isAlert, panelRows, statusText } from './model';

const PANEL_ID = 'monarch-nb-mesh-panel';

class StatusItem extends Widget {
  constructor() {
    super();
    this.addClass('mnb-lab-status');
    this.node.title = 'monarch_nb mesh (click for the panel)';
  }

  display(connector: Connector | null): void {
    const mesh = connector?.model.mesh;
    this.node.textContent = statusText(mesh);
    this.toggleClass('mnb-lab-alert', isAlert(mesh));
    this.node.dataset.up = mesh ? String(mesh.up) : '';
    this.node.dataset.world = mesh ? String(mesh.world) : '';
    this.node.style.display = mesh === undefined ? 'none' : '';
  }
}

class MeshPanel extends Widget {
  private connector: Connector | null = null;

  constructor() {
    super();
    this.id = PANEL_ID;
    this.addClass('mnb-lab-panel');
    this.title.caption = 'monarch_nb mesh';
    this.title.label = 'Mesh';
  }

  display(connector: Connector | null): void {
    this.connector = connector;
    const model = connector?.model;
    const mesh = model?.mesh;
    const node = this.node;
    node.textContent = '';
    const head = document.createElement('div');
    head.className = 'mnb-lab-head' + (isAlert(mesh) ? ' mnb-lab-alert' : '');
    head.textContent =
      mesh === undefined ? 'no monarch_nb kernel (run %load_ext monarch_nb)' : statusText(mesh);
    node.appendChild(head);
    if (!mesh || !model) {
      return;
    }
    const table = document.createElement('table');
    table.className = 'mnb-lab-ranks';
    const tr = table.createTHead().insertRow();
    [...COLUMNS, ''].forEach((c, i) => {
      const th = document.createElement('th');
      th.textContent = c;
      th.title = COLUMN_TITLES[i] ?? '';
      tr.appendChild(th);
    });
    const body = table.createTBody();
    panelRows(mesh).forEach((cells, i) => {
      const rank = mesh.ranks[i];
      const row = body.insertRow();
      row.dataset.rank = String(rank.rank);
      row.dataset.state = rank.state;
      row.className = 'mnb-lab-rank mnb-lab-state-' + rank.state;
      for (const text of cells) {
        row.insertCell().textContent = text;
      }
      const cell = row.insertCell();
      if (canRestart(mesh, rank)) {
        const button = document.createElement('button');
        button.className = 'jp-Button mnb-lab-restart';
        button.textContent = '↻';
        button.title = `restart rank ${rank.rank} (mesh.restart(${rank.rank}))`;
        button.onclick = () => this.connector?.send({ action: 'restart', rank: rank.rank });
        cell.appendChild(button);
      }
    });
    node.appendChild(table);
    if (mesh.state === 'running') {
      const stacks = document.createElement('button');
      stacks.className = 'jp-Button mnb-lab-stacks-button';
      stacks.textContent = 'stacks';
      stacks.title = 'where every rank is (mesh.stacks(), grouped)';
      stacks.onclick = () => this.connector?.send({ action: 'stacks' });
      node.appendChild(stacks);
    }
    if (model.notice) {
      const notice = document.createElement('div');
      notice.className = 'mnb-lab-notice' + (model.noticeIsError ? ' mnb-lab-alert' : '');
      notice.textContent = model.notice;
      node.appendChild(notice);
    }
    if (model.stacks) {
      const pre = document.createElement('pre');
      pre.className = 'mnb-lab-stacks';
      pre.textContent = model.stacks;
      node.appendChild(pre);
    }
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-nb-lab:plugin',
  description: "The active kernel's monarch_nb mesh: status bar and side panel.",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    labShell: ILabShell | null
  ) => {
    const connectors = new Map<NotebookPanel, Connector>();
    const item = new StatusItem();
    const panel = new MeshPanel();
    app.shell.add(panel, 'right', { rank: 900 });
    item.node.onclick = () => labShell?.activateById(PANEL_ID);

    const current = (): Connector | null => {
      const nb = tracker.currentWidget;
      return nb ? connectors.get(nb) ?? null : null;
    };
    const render = () => {
      const c = current();
      item.display(c);
      panel.display(c);
    };

    tracker.widgetAdded.connect((_, nb) => {
      const connector = new Connector(nb.sessionContext);
      connector.onChange(() => {
        if (tracker.currentWidget === nb) {
          render();
        }
      });
      connectors.set(nb, connector);
      nb.disposed.connect(() => {
        connector.dispose();
        connectors.delete(nb);
        render();
      });
    });
    tracker.currentChanged.connect(render);

    if (statusBar) {
      statusBar.registerStatusItem('monarch-nb-lab:status', {
        item,
        align: 'left',
        rank: 4
      });
    }
    render();
  }
};

export default plugin;
