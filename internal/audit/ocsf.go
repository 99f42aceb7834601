package audit

import (
	"encoding/json"
	"net"
	"strconv"
	"strings"
)

// OCSF classes the export maps records to (OCSF 1.1).
const (
	ocsfVersion         = "1.1.0"
	ocsfBaseEvent       = 0
	ocsfFileSystem      = 1001 // System Activity
	ocsfProcess         = 1007 // System Activity
	ocsfNetwork         = 4001 // Network Activity
	ocsfAPI             = 6003 // Application Activity
	ocsfStatusSuccess   = 1
	ocsfStatusFailure   = 2
	ocsfSeverityInfo    = 1
	ocsfSeverityMedium  = 3
	ocsfActivityOther   = 99
	ocsfActivityUnknown = 0
)

var ocsfNames = map[int][2]string{
	ocsfBaseEvent:  {"Base Event", "Uncategorized"},
	ocsfFileSystem: {"File System Activity", "System Activity"},
	ocsfProcess:    {"Process Activity", "System Activity"},
	ocsfNetwork:    {"Network Activity", "Network Activity"},
	ocsfAPI:        {"API Activity", "Application Activity"},
}

// OCSF maps a record to an OCSF-shaped event: class_uid, category_uid,
// activity_id, type_uid, time (ms), severity_id, status, actor (the API
// key), metadata (product, version, the record's seq and hash), the
// class's own objects, and the whole record in unmapped so nothing is
// lost. api → API Activity, command → Process Activity, files → File
// System Activity, network → Network Activity, lifecycle, secret,
// policy, approval, key → API Activity, the log's own records → Base Event.
func OCSF(r Record) map[string]any {
	var detail map[string]any
	_ = json.Unmarshal(r.Detail, &detail)
	class, activity := ocsfBaseEvent, ocsfActivityOther
	failed := false
	ev := map[string]any{}
	switch r.Kind {
	case KindAPI:
		class = ocsfAPI
		method, _, _ := strings.Cut(r.Action, " ")
		activity = httpActivity(method)
		status, _ := strconv.Atoi(r.Result)
		failed = status >= 400
		api := map[string]any{"operation": r.Action}
		if status != 0 {
			api["response"] = map[string]any{"code": status}
		}
		ev["api"] = api
		req := map[string]any{"http_method": method}
		if p, ok := detail["path"].(string); ok {
			req["url"] = map[string]any{"path": p}
		}
		ev["http_request"] = req
		if ra, ok := detail["remote"].(string); ok {
			ev["src_endpoint"] = endpoint(ra)
		}
	case KindCommand:
		class = ocsfProcess
		proc := map[string]any{}
		if a, ok := detail["argv"].([]any); ok {
			parts := make([]string, 0, len(a))
			for _, x := range a {
				s, _ := x.(string)
				parts = append(parts, s)
			}
			proc["cmd_line"] = strings.Join(parts, " ")
		}
		if u, ok := detail["user"].(string); ok && u != "" {
			proc["user"] = map[string]any{"name": u}
		}
		if c, ok := detail["cwd"].(string); ok && c != "" {
			proc["working_directory"] = c
		}
		if r.Target != "" {
			proc["uid"] = r.Target
		}
		ev["process"] = proc
		switch r.Action {
		case "start":
			activity = 1 // Launch
			failed = r.Result != "" && r.Result != "ok" && r.Result != "started"
		case "exit":
			activity = 2 // Terminate
			if c, err := strconv.Atoi(r.Result); err == nil {
				ev["exit_code"] = c
			}
		}
	case KindFiles:
		class = ocsfFileSystem
		switch r.Action {
		case "mkdir":
			activity = 1 // Create
		case "write", "tar_put":
			activity = 3 // Update
		case "remove":
			activity = 4 // Delete
		case "rename":
			activity = 5 // Rename
		}
		ev["file"] = map[string]any{"path": r.Target, "name": baseName(r.Target), "type_id": 0}
		failed = r.Result != "" && r.Result != "ok"
	case KindNetwork:
		class = ocsfNetwork
		verdict, _ := detail["verdict"].(string)
		switch verdict {
		case "allow":
			activity = 1 // Open
		case "deny", "drop", "limit":
			activity = 5 // Refuse
			failed = true
		case "error":
			activity = 4 // Fail
			failed = true
		}
		dst := map[string]any{}
		if ip, ok := detail["ip"].(string); ok && ip != "" {
			dst["ip"] = ip
		}
		if p, ok := detail["port"].(float64); ok && p > 0 {
			dst["port"] = int(p)
		}
		if n, ok := detail["name"].(string); ok && n != "" {
			dst["hostname"] = n
		}
		ev["dst_endpoint"] = dst
		if p, ok := detail["protocol"].(string); ok {
			ev["connection_info"] = map[string]any{"protocol_name": p}
		}
		ev["disposition"] = verdict
	case KindLifecycle, KindSecret, KindPolicy, KindApproval, KindKey:
		class = ocsfAPI
		activity = ocsfActivityOther
		if r.Kind == KindLifecycle && r.Action == "create" {
			activity = 1
		} else if r.Kind == KindLifecycle && r.Action == "delete" {
			activity = 4
		}
		ev["api"] = map[string]any{"operation": r.Kind + ":" + r.Action}
		failed = strings.HasPrefix(r.Result, "fail") || strings.HasPrefix(r.Result, "den") || strings.HasPrefix(r.Result, "error")
	default:
		class, activity = ocsfBaseEvent, ocsfActivityOther
	}
	names := ocsfNames[class]
	ev["class_uid"] = class
	ev["class_name"] = names[0]
	ev["category_uid"] = class / 1000
	ev["category_name"] = names[1]
	ev["activity_id"] = activity
	if class == ocsfBaseEvent {
		ev["activity_id"] = ocsfActivityOther
	}
	ev["type_uid"] = class*100 + ev["activity_id"].(int)
	ev["time"] = r.Time.UnixMilli()
	ev["status_id"] = ocsfStatusSuccess
	ev["severity_id"] = ocsfSeverityInfo
	if failed {
		ev["status_id"] = ocsfStatusFailure
		ev["severity_id"] = ocsfSeverityMedium
	}
	if r.Result != "" {
		ev["status_detail"] = r.Result
	}
	ev["message"] = strings.TrimSpace(r.Kind + " " + r.Action + " " + r.Target)
	user := map[string]any{"uid": r.KeyID}
	if r.Tenant != "" {
		user["org"] = map[string]any{"uid": r.Tenant}
	}
	ev["actor"] = map[string]any{"user": user}
	ev["metadata"] = map[string]any{
		"version":    ocsfVersion,
		"product":    map[string]any{"name": "space", "vendor_name": "space", "feature": map[string]any{"name": "audit"}},
		"uid":        strconv.FormatUint(r.Seq, 10),
		"log_name":   "space-audit",
		"sequence":   r.Seq,
		"tenant_uid": r.Tenant,
	}
	if r.Sandbox != "" {
		ev["resources"] = []any{map[string]any{"uid": r.Sandbox, "type": "sandbox"}}
	}
	ev["unmapped"] = map[string]any{"space_audit": r}
	return ev
}

func httpActivity(method string) int {
	switch method {
	case "POST":
		return 1 // Create
	case "GET", "HEAD":
		return 2 // Read
	case "PUT", "PATCH":
		return 3 // Update
	case "DELETE":
		return 4 // Delete
	}
	return ocsfActivityOther
}

func endpoint(hostport string) map[string]any {
	h, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return map[string]any{"ip": hostport}
	}
	out := map[string]any{"ip": h}
	if n, err := strconv.Atoi(p); err == nil {
		out["port"] = n
	}
	return out
}

func baseName(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[i+1:]
	}
	return p
}
