package replica

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"sort"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// Approvals through a replica: an approval is held by the node whose
// sandbox asked, so a listing for one sandbox goes to its node (a follow
// included), a listing of all is the union of the nodes' answers, and an
// answer goes to the node that holds the approval.

// approvals serves approvals through a replica.
type approvals struct {
	nodes *nodeClient
}

// maxApprovalAnswer bounds an approve/deny body.
const maxApprovalAnswer = 64 << 10

func (a *approvals) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	q := req.URL.Query()
	if id := q.Get("sandbox"); id != "" {
		n, err := a.nodes.sandboxNode(req.Context(), id, &p)
		if err != nil {
			server.WriteError(w, req, err)
			return
		}
		a.nodes.proxy(w, req, n, &p)
		return
	}
	if follow, err := server.ParseBool(q.Get("follow"), "follow"); err != nil || follow {
		if err == nil {
			err = fmt.Errorf("through a cluster replica, follow=true needs sandbox=ID (approvals are held by each sandbox's node): %w", errdefs.ErrInvalidArgument)
		}
		server.WriteError(w, req, err)
		return
	}
	out := api.ApprovalList{Approvals: []api.Approval{}}
	ok := a.nodes.askReadyNodes(w, req, "/v1/approvals?"+q.Encode(), &p, server.WriteError, func(_ clusterstore.Node, body io.Reader) error {
		var part api.ApprovalList
		if err := json.NewDecoder(body).Decode(&part); err != nil {
			return err
		}
		out.Approvals = append(out.Approvals, part.Approvals...)
		out.Proposals = append(out.Proposals, part.Proposals...)
		return nil
	})
	if !ok {
		return
	}
	sort.SliceStable(out.Approvals, func(i, j int) bool { return out.Approvals[i].CreatedAt.Before(out.Approvals[j].CreatedAt) })
	server.WriteJSON(w, http.StatusOK, out)
}

// answerApproval asks each ready node in turn to answer the approval
// until one holds it (an approval's id does not say where it is).
func (a *approvals) answer(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	// The table's routes name the verb (…/approve, …/deny); the replica's
	// own …/{verb} catches the rest.
	verb := req.PathValue("verb")
	if verb == "" {
		verb = path.Base(req.URL.Path)
	}
	if verb != "approve" && verb != "deny" {
		server.WriteError(w, req, fmt.Errorf("no route for %s %s (answer with …/approve or …/deny): %w", req.Method, req.URL.Path, errdefs.ErrNotFound))
		return
	}
	body, err := io.ReadAll(io.LimitReader(req.Body, maxApprovalAnswer+1))
	if err != nil || len(body) > maxApprovalAnswer {
		server.WriteError(w, req, fmt.Errorf("an approval's answer must be JSON of at most %d bytes: %w", maxApprovalAnswer, errdefs.ErrInvalidArgument))
		return
	}
	if len(body) == 0 {
		body = nil
	}
	nodes, err := a.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	to := "/v1/approvals/" + url.PathEscape(req.PathValue("id")) + "/" + verb
	for _, n := range nodes {
		if n.State != clusterstore.NodeReady {
			continue
		}
		resp, err := a.nodes.forwardFor(req.Context(), req, n, http.MethodPost, to, body, &p, "")
		if err != nil {
			continue // a node that does not answer holds nothing it can decide now
		}
		if resp.StatusCode == http.StatusNotFound {
			resp.Body.Close()
			continue
		}
		defer resp.Body.Close()
		copyResponse(w, resp, n.ID)
		return
	}
	server.WriteError(w, req, fmt.Errorf("approval %q: %w", req.PathValue("id"), errdefs.ErrNotFound))
}
